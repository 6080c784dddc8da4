//! A layer's launches: in one kernel (`layer_fused`), or split over the main and side
//! streams (select, plan, attention, merge), and the log-sum-exp merge that ends either.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, LaunchConfig};

use super::device::DeviceTail;
use super::step::{LayerIo, LayerStart};
use super::CudaBackend;
use crate::cuda::config::{SCORE_NB, SCORE_THREADS};
use crate::cuda::error::{CudaError, Result};
use crate::cuda::params::{
    AttendMergeParams, AttendTileParams, LayerFusedParams, PlanFixedParams, SelectRerankParams,
    SelectScoreParams, SelectTopkParams,
};

impl CudaBackend {
    /// Enqueues layer `l`; returns the tickets its layer_fused launch takes (0 unfused).
    pub(super) fn enqueue_layer(
        &self,
        l: usize,
        io: LayerIo,
        b: usize,
        (min_nb, max_nb): (u32, u32),
        start: LayerStart,
    ) -> Result<u32> {
        let g = self.cfg.geometry;
        let p = self.cfg.policy;
        let bmax = self.cfg.max_batch as usize;
        let ks = self.derived.keep_max;
        let hkv = g.kv_heads;
        let bu = b as u32;
        let layer = l as u32;
        let mb = self.cfg.max_blocks;
        let LayerIo {
            sess,
            q,
            ntok,
            out,
            lse,
            tail,
        } = io;
        let table = self.table.at(l * bmax * (hkv * ks) as usize);
        let counts = self.counts.at(l * bmax * hkv as usize);
        let cfg = |grid: (u32, u32, u32), threads: u32| LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let k = &self.k;
        let (main, side) = (&self.stream, &self.side);
        let scale = self.softmax_scale();
        let attend = |stream: &Arc<CudaStream>, part: u32, tiles: u32| {
            self.launch(
                stream,
                &k.attend_tile,
                LaunchConfig {
                    grid_dim: (tiles, hkv, bu),
                    block_dim: (self.derived.att_threads, 1, 1),
                    shared_mem_bytes: self.derived.att_dyn_smem,
                },
                &AttendTileParams {
                    q,
                    sess,
                    ntok,
                    table,
                    slot_of: self.slot_of.ptr,
                    miss_src: self.miss_src.ptr,
                    cache: self.cache.ptr,
                    part_acc: self.part_acc.ptr,
                    part_ml: self.part_ml.ptr,
                    layer,
                    scale,
                    part,
                },
            )
        };

        // Score roles: records per octet and thread blocks (candidate lists) per kv head.
        let records = max_nb * self.cfg.summary_records();
        let nbo = self.score_blocks_per_octet(records, hkv * bu);
        let lists = records.div_ceil(nbo * (SCORE_THREADS / 8));
        // The sketch selector's rerank roles per kv head (none without it).
        let reranks = if self.cfg.sketch() {
            self.derived.scan.div_ceil(self.derived.rerank_per_role)
        } else {
            0
        };
        // select_score's parameters, which layer_fused's begin with.
        let score = SelectScoreParams {
            q,
            sums: self.sums.ptr,
            qscales: self.qscales.ptr,
            sess,
            ntok,
            scratch: self.scores.ptr,
            done: self.done.ptr,
            table,
            tags: self.tags.ptr,
            stamps: self.stamps.ptr,
            pages: self.pages.ptr,
            slot_of: self.slot_of.ptr,
            miss_src: self.miss_src.ptr,
            stats: self.stats.ptr,
            cands: self.cands.ptr,
            layer,
            max_blocks: mb,
            nbo,
        };

        self.record(l, 0)?;
        if let (true, Some(fused)) = (self.fused[l], &k.layer_fused) {
            // Everything but the merge in one launch on the main stream (select.cu).
            // A short layer's fixed part is all its blocks, up to KSEL tiles.
            let nfixed = if min_nb <= ks {
                ks
            } else {
                p.sink_blocks + p.local_blocks
            };
            let ctas = (1 + nfixed + lists + reranks + p.top_k) * hkv * bu;
            let s = score;
            let params = LayerFusedParams {
                q: s.q,
                sums: s.sums,
                qscales: s.qscales,
                sess: s.sess,
                ntok: s.ntok,
                scratch: s.scratch,
                done: s.done,
                table: s.table,
                tags: s.tags,
                stamps: s.stamps,
                pages: s.pages,
                slot_of: s.slot_of,
                miss_src: s.miss_src,
                stats: s.stats,
                counts,
                cache: self.cache.ptr,
                part_acc: self.part_acc.ptr,
                part_ml: self.part_ml.ptr,
                ready: self.ready.ptr,
                tickets: self.tickets.ptr,
                layer: s.layer,
                max_blocks: s.max_blocks,
                nbo: s.nbo,
                stamp: self.stamp,
                scale,
                ticket0: self.tickets_issued,
                lists,
                nfixed,
                batch: bu,
                cands: s.cands,
                rkeys: self.rkeys.ptr,
                rdone: self.rdone.ptr,
                sketches: self.sketches.ptr,
            };
            if start == LayerStart::Replayable {
                // A captured launch replays with the stamp and ticket base it was captured
                // with: the ticket counter is set to that base and the ready flags cleared
                // (no flag may already hold the stamp) on the stream first. Eagerly this only
                // rewrites the values they already have.
                self.memset_u32(self.tickets.ptr, self.tickets_issued, 1)?;
                self.memset_u32(self.ready.ptr, 0, self.ready.slice.len())?;
            }
            // Within a call every layer ends with its merge on the main stream, and with
            // dependent launch no event sits between (dependent_launch).
            self.launch_after(
                main,
                fused,
                LaunchConfig {
                    grid_dim: (ctas, 1, 1),
                    block_dim: (SCORE_THREADS, 1, 1),
                    shared_mem_bytes: self.derived.att_dyn_smem,
                },
                &params,
                start == LayerStart::Chained,
            )?;
            self.record(l, 1)?;
            self.merge(l, bu, counts, (q, out, lse, tail), true)?;
            return Ok(ctas);
        }
        let rec = |e: &CudaEvent, st: &Arc<CudaStream>| {
            e.record(st).map_err(CudaError::driver("cuEventRecord"))
        };
        let wait = |st: &Arc<CudaStream>, e: &CudaEvent| {
            st.wait(e).map_err(CudaError::driver("cuStreamWaitEvent"))
        };
        // Side: plan the fixed part, then fetch + attend it, while main selects.
        rec(&self.fork, main)?;
        wait(side, &self.fork)?;
        self.launch(
            side,
            &k.plan_fixed,
            cfg((hkv, bu, 1), 128),
            &PlanFixedParams {
                ntok,
                table,
                counts,
                sess,
                tags: self.tags.ptr,
                stamps: self.stamps.ptr,
                pages: self.pages.ptr,
                slot_of: self.slot_of.ptr,
                miss_src: self.miss_src.ptr,
                stats: self.stats.ptr,
                max_blocks: mb,
                layer,
            },
        )?;
        attend(side, 0, ks)?;
        rec(&self.join, side)?;

        self.launch(
            main,
            &k.select_score,
            cfg((lists, hkv, bu), SCORE_THREADS),
            &score,
        )?;
        if reranks > 0 {
            self.launch(
                main,
                &k.select_rerank,
                cfg((reranks, hkv, bu), SCORE_THREADS),
                &SelectRerankParams {
                    q,
                    sketches: self.sketches.ptr,
                    sess,
                    ntok,
                    cands: self.cands.ptr,
                    rkeys: self.rkeys.ptr,
                    rdone: self.rdone.ptr,
                    table,
                    tags: self.tags.ptr,
                    stamps: self.stamps.ptr,
                    pages: self.pages.ptr,
                    slot_of: self.slot_of.ptr,
                    miss_src: self.miss_src.ptr,
                    stats: self.stats.ptr,
                    max_blocks: mb,
                    layer,
                },
            )?;
        }
        if !self.derived.topk_merge {
            self.launch(
                main,
                &k.select_topk,
                cfg((hkv, bu, 1), 1024),
                &SelectTopkParams {
                    scratch: self.scores.ptr,
                    ntok,
                    table,
                    sess,
                    tags: self.tags.ptr,
                    stamps: self.stamps.ptr,
                    pages: self.pages.ptr,
                    slot_of: self.slot_of.ptr,
                    miss_src: self.miss_src.ptr,
                    stats: self.stats.ptr,
                    max_blocks: mb,
                    layer,
                },
            )?;
        }
        self.record(l, 1)?;
        attend(main, 1, p.top_k.max(1))?;
        wait(main, &self.join)?;
        self.merge(l, bu, counts, (q, out, lse, tail), false)?;
        Ok(0)
    }

    /// The layer's last launch: the log-sum-exp merge of its partials and `tail` (q's
    /// attention over it) into `out` (and each output's log-sum-exp into `lse` unless 0);
    /// `after_kernel` as in [`Self::launch_after`].
    fn merge(
        &self,
        l: usize,
        bu: u32,
        counts: u64,
        (q, out, lse, tail): (u64, u64, u64, DeviceTail),
        after_kernel: bool,
    ) -> Result<()> {
        let g = self.cfg.geometry;
        self.launch_after(
            &self.stream,
            &self.k.attend_merge,
            LaunchConfig {
                grid_dim: (g.q_heads, bu, 1),
                block_dim: (g.head_dim, 1, 1),
                shared_mem_bytes: 0,
            },
            &AttendMergeParams {
                counts,
                part_acc: self.part_acc.ptr,
                part_ml: self.part_ml.ptr,
                out,
                lse,
                q,
                tail_kv: tail.kv,
                tail_last: tail.last,
                scale: self.softmax_scale(),
            },
            after_kernel,
        )?;
        self.record(l, 2)
    }

    /// Records each select_score octet scores: the most (fewest candidate lists to merge, the
    /// query loaded once per more records) that still gives every multiprocessor a thread
    /// block.
    fn score_blocks_per_octet(&self, records: u32, heads: u32) -> u32 {
        let octets = SCORE_THREADS / 8;
        let mut nbo = SCORE_NB;
        while nbo > 1 && records.div_ceil(nbo * octets) * heads < self.sms {
            nbo /= 2;
        }
        nbo
    }
}
