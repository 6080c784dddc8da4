//! Appends from the engine's device memory into tierd's arena by DMA (RESERVE, copy, COMMIT),
//! all layers at once or layer by layer while the model computes the later ones, and the
//! device state that follows them.

use std::ops::Range;
use std::time::{Duration, Instant};

use kvtier_kernels::cuda::CUstream;
use kvtier_protocol::{LeaseLayer, LeaseReply, ReserveReply};

use crate::{EngineError, HeadShard, InEngine, Result};

/// Rows an engine appends from its device memory ([`InEngine::append_from_device`]): per layer
/// `[kv_heads][2][capacity][head_dim]` elements of the sessions' dtype (each KV head's K rows,
/// then its V rows, `capacity` slots each, the rows to append first), layer `l` at
/// `ptr + l * layer_stride` bytes. A block run's layout with `capacity` for `block_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRows {
    pub ptr: u64,
    pub layer_stride: u64,
    pub capacity: u32,
}

/// The phases of one [`InEngine::append_from_device`] or append by layer, summed over its
/// sessions. By layer the committer's phases run beside the caller and beside one another, so
/// their sum is not the time the caller waited.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AppendTiming {
    /// RESERVE round trips.
    pub reserve: Duration,
    /// Enqueueing the DMA copies and waiting for them.
    pub copy: Duration,
    /// COMMIT round trips (the daemon checks the rows and folds their bounds).
    pub commit: Duration,
    /// The engine's device state following the reservations (bounds of the new blocks
    /// recomputed from the runs, uploads).
    pub sync: Duration,
}

impl InEngine {
    /// Lets [`InEngine::append_from_device`] write into tierd's arena: the arena is then mapped
    /// and registered read-write (the device may write it) instead of read-only. Call before
    /// the first attach; an engine of every KV head only (an append writes whole rows).
    pub fn enable_in_place_appends(&mut self) -> Result<()> {
        if self.shard != HeadShard::WHOLE {
            return Err(EngineError::InPlace(format!(
                "head shard {} of {} holds part of each row; in-place appends need every head",
                self.shard.rank, self.shard.world
            )));
        }
        if self.mapped.is_some() && !self.in_place {
            return Err(EngineError::InPlace(
                "the arena is already mapped read-only: enable in-place appends before the \
                 first attach"
                    .into(),
            ));
        }
        self.in_place = true;
        Ok(())
    }

    /// Appends `tokens` rows to every layer of each attached session, straight from device
    /// memory: RESERVE (each session), one DMA copy per layer and block on `stream` (behind the
    /// work that produced the rows), a wait for them, COMMIT, and the device state updated
    /// from the RESERVE reply. Rows that are not finite make that session's COMMIT fail
    /// (INVALID_ARGUMENT, nothing appended); the others still append, and the first error is
    /// returned. Bind again afterwards. Needs [`InEngine::enable_in_place_appends`].
    ///
    /// # Safety
    /// Each item's rows (as [`DeviceRows`] lays them out, `tokens` of each layer) are device
    /// memory of the engine's device (primary context) that stays allocated and unchanged
    /// until this returns; `stream` is a live stream of that context.
    pub unsafe fn append_from_device(
        &mut self,
        items: &[(u64, DeviceRows)],
        tokens: u32,
        stream: CUstream,
    ) -> Result<()> {
        self.check_in_place()?;
        for &(session, rows) in items {
            self.slot_of(session)?;
            if tokens == 0 || tokens > rows.capacity {
                return Err(EngineError::InPlace(format!(
                    "session {session}: {tokens} rows from a buffer of {} slots",
                    rows.capacity
                )));
            }
        }
        let mut timing = AppendTiming::default();
        let t = Instant::now();
        let sessions: Vec<(u64, u32)> = items.iter().map(|&(s, _)| (s, tokens)).collect();
        let reserved = self.reserve_each(&sessions)?;
        timing.reserve = t.elapsed();
        let t = Instant::now();
        let copied = items
            .iter()
            .zip(&reserved)
            .try_for_each(|(&(_, rows), r)| {
                // SAFETY: the caller's contract on the rows and the stream, passed on.
                unsafe { self.enqueue_rows(rows, r, 0..r.layers.len(), stream) }
            })
            // SAFETY: the caller's contract: `stream` is a live stream of the context.
            .and_then(|()| Ok(unsafe { self.be.synchronize_caller(stream) }?));
        if let Err(e) = copied {
            // A copy may still be in flight only if enqueueing failed part way; the
            // reservations go either way (COMMIT 0 drops their rows).
            self.drop_reservations(items.iter().map(|&(s, _)| s));
            return Err(e);
        }
        timing.copy = t.elapsed();
        let mut first = None;
        for (&(session, _), r) in items.iter().zip(&reserved) {
            let t = Instant::now();
            let committed = self.client()?.commit(session, tokens);
            timing.commit += t.elapsed();
            let t = Instant::now();
            let done = committed
                .map_err(EngineError::from)
                .and_then(|_| self.sync_reserved(session, r));
            timing.sync += t.elapsed();
            if let Err(e) = done {
                first.get_or_insert(e);
            }
        }
        self.last_append = Some(timing);
        first.map_or(Ok(()), Err)
    }

    /// Where the last [`InEngine::append_from_device`] that reached its copies spent its time.
    pub fn last_append(&self) -> Option<AppendTiming> {
        self.last_append
    }

    /// Enqueues the copies of one session's rows to where `r` reserved them: per layer, one
    /// 2D copy per block touched (rows `[kv_heads][2]`, each of the block's part of the rows).
    ///
    /// # Safety
    /// As [`InEngine::append_from_device`].
    pub(crate) unsafe fn enqueue_rows(
        &self,
        rows: DeviceRows,
        r: &ReserveReply,
        layers: Range<usize>,
        stream: CUstream,
    ) -> Result<()> {
        let region = &self.mapped.as_ref().expect("leased, so mapped").region;
        let g = &self.full;
        let (bt, row) = (g.block_tokens as u64, g.row_bytes() as u64);
        let first_block = r.start / bt;
        for (l, offsets) in r
            .layers
            .iter()
            .enumerate()
            .take(layers.end)
            .skip(layers.start)
        {
            let src = rows.ptr + (l - layers.start) as u64 * rows.layer_stride;
            let mut i = 0u64;
            while i < u64::from(r.tokens) {
                let pos = r.start + i;
                let block = (pos / bt - first_block) as usize;
                let run = *offsets.get(block).ok_or(EngineError::Unmapped {
                    layer: l,
                    block: (pos / bt) as usize,
                })?;
                let n = (bt - pos % bt).min(u64::from(r.tokens) - i);
                // SAFETY: the destination rows are this connection's reservation (the
                // daemon neither reads nor moves them before COMMIT); the source is the
                // caller's contract.
                unsafe {
                    region.enqueue_copy_in(
                        run + (pos % bt) * row,
                        g.half_tile_bytes() as u64,
                        src + i * row,
                        u64::from(rows.capacity) * row,
                        n * row,
                        2 * u64::from(g.kv_heads),
                        stream,
                    )
                }?;
                i += n;
            }
        }
        Ok(())
    }

    /// Errs unless [`InEngine::enable_in_place_appends`] was called.
    pub(crate) fn check_in_place(&self) -> Result<()> {
        match self.in_place {
            true => Ok(()),
            false => Err(EngineError::InPlace(
                "not enabled on this engine (enable_in_place_appends)".into(),
            )),
        }
    }

    /// RESERVEs `tokens` rows in each `(session, tokens)`, in order; on an error the
    /// reservations made so far are dropped.
    pub(crate) fn reserve_each(&mut self, items: &[(u64, u32)]) -> Result<Vec<ReserveReply>> {
        let mut reserved = Vec::with_capacity(items.len());
        for &(session, tokens) in items {
            match self.client()?.reserve(session, tokens) {
                Ok(r) => reserved.push(r),
                Err(e) => {
                    self.drop_reservations(items[..reserved.len()].iter().map(|&(s, _)| s));
                    return Err(e.into());
                }
            }
        }
        Ok(reserved)
    }

    /// COMMITs 0 rows (drops the reservation) in each of `sessions`; best effort, on an error
    /// path.
    pub(crate) fn drop_reservations(&mut self, sessions: impl IntoIterator<Item = u64>) {
        for session in sessions {
            if let Ok(c) = self.client() {
                let _ = c.commit(session, 0);
            }
        }
    }

    /// Updates the device state of `session` after a COMMIT of what `r` reserved: its table is
    /// the held one up to `r.start` plus `r`'s runs. When the held state does not end where `r`
    /// starts (something else appended meanwhile), a full [`InEngine::sync`] instead.
    fn sync_reserved(&mut self, session: u64, r: &ReserveReply) -> Result<()> {
        match self.reserved_table(session, r, 0..r.layers.len()) {
            Some(lease) => self.apply(session, &lease, 0..r.layers.len()),
            None => self.sync(session),
        }
    }

    /// The table of `session`'s layers `layers` after a COMMIT of what `r` reserved (the
    /// other layers' entries empty): the held one up to `r.start` plus `r`'s runs; None when
    /// the held state of one of them does not end where `r` starts.
    pub(crate) fn reserved_table(
        &self,
        session: u64,
        r: &ReserveReply,
        layers: Range<usize>,
    ) -> Option<LeaseReply> {
        let m = self.mapped.as_ref().expect("leased, so mapped");
        let s = self.sessions.get(&session).expect("attached");
        let g = &self.full;
        let bt = u64::from(g.block_tokens);
        let keep = (r.start / bt) as usize;
        let end = r.start + u64::from(r.tokens);
        let mut table = vec![
            LeaseLayer {
                tokens: 0,
                offsets: Vec::new()
            };
            r.layers.len()
        ];
        for l in layers {
            let (ls, new) = (&s.layers[l], &r.layers[l]);
            let held = ls.tokens() == r.start
                && ls.extents().len() == g.blocks_for(r.start) as usize
                && new.len() == g.blocks_for(end) as usize - keep
                // A partial block: the reservation continues the held run.
                && ls.extents().get(keep).is_none_or(|&o| Some(&o) == new.first());
            if !held {
                return None;
            }
            let mut offsets = ls.extents()[..keep].to_vec();
            offsets.extend_from_slice(new);
            table[l] = LeaseLayer {
                tokens: end,
                offsets,
            };
        }
        Some(LeaseReply {
            instance: m.instance,
            arena_bytes: m.view.len() as u64,
            run_bytes: g.block_bytes() as u64,
            layers: table,
        })
    }
}
