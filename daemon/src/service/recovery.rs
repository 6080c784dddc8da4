//! Warm restart: every session the NVMe manifest holds is read back, verified and rebuilt;
//! one that cannot be is kept listed as damaged.

use super::*;

/// The geometry a manifest record stores.
pub(super) fn geometry_of(g: &GeometryRecord) -> ServiceResult<Geometry> {
    g.geometry()
        .ok_or_else(|| ServiceError::internal(format!("unknown dtype {}", g.dtype)))
}

pub(super) fn policy_of(p: &PolicyRecord) -> ServiceResult<Policy> {
    p.policy()
        .ok_or_else(|| ServiceError::internal(format!("unknown selector {}", p.selector)))
}

/// What rebuilding a stored session follows: its policy and the (layer, block) runs its record
/// holds, in the order the cache is rebuilt (layer by layer, block by block).
pub(super) struct Rebuild {
    pub policy: Policy,
    pub wanted: Vec<(u32, u32)>,
    tokens: Vec<u64>,
    block_tokens: u64,
}

impl Rebuild {
    /// The rows of `(layer, block)` the record holds.
    pub fn valid(&self, layer: u32, block: u32) -> usize {
        let tokens = *self.tokens.get(layer as usize).unwrap_or(&0);
        (tokens - block as u64 * self.block_tokens).min(self.block_tokens) as usize
    }
}

impl Service {
    /// [`Rebuild`] of the session `rec` describes, and the empty cache to rebuild (its
    /// geometry, charged to its owner).
    pub(super) fn rebuild(&self, rec: &SessionRecord) -> ServiceResult<(Rebuild, KvCache)> {
        let geometry = geometry_of(&rec.geometry)?;
        let policy = policy_of(&rec.policy)?;
        let kv = KvCache::new_with(
            geometry,
            self.arena_for(rec.owner_uid),
            policy.selector.needs_sketches(),
        )?;
        let tokens = |l: u32| *rec.layer_tokens.get(l as usize).unwrap_or(&0);
        let wanted = (0..geometry.layers)
            .flat_map(|l| (0..geometry.blocks_for(tokens(l)) as u32).map(move |b| (l, b)))
            .collect();
        let rb = Rebuild {
            policy,
            wanted,
            tokens: rec.layer_tokens.clone(),
            block_tokens: geometry.block_tokens as u64,
        };
        Ok((rb, kv))
    }

    /// Loads every session the NVMe manifest holds (warm restart): reads and verifies each
    /// page, rebuilds tiles and bounds bit-identically, keeping blocks resident while the host
    /// tier is below its low-water mark and cold after that. A session that cannot be read
    /// back is left on NVMe, not served, and reported.
    pub fn recover(&self) -> (usize, Vec<String>) {
        let Some((tier, t)) = &self.tier else {
            return (0, Vec::new());
        };
        let mut problems = Vec::new();
        let mut loaded = 0;
        // Pinned sessions first: they get host extents while the tier is below low water.
        let mut records: Vec<SessionRecord> = tier
            .session_ids()
            .into_iter()
            .filter_map(|id| tier.session(id))
            .collect();
        records.sort_by_key(|r| (!r.pinned, r.id));
        for rec in records {
            let id = rec.id;
            match self.restore(tier, t, &rec) {
                Ok(session) => {
                    self.gpu_open(id, &session.geometry, &session.policy);
                    self.sessions.write().insert(id, Arc::new(session));
                    loaded += 1;
                }
                Err(e) => {
                    // Listed as damaged, its record and pages left as they are on NVMe.
                    problems.push(format!("session {id}: {e} (listed as damaged)"));
                    match self.damaged_session(&rec, e.to_string()) {
                        Ok(s) => {
                            self.sessions.write().insert(id, Arc::new(s));
                        }
                        Err(e) => problems.push(format!("session {id}: not listed: {e}")),
                    }
                }
            }
        }
        (loaded, problems)
    }

    /// The table entry of a stored session that could not be restored.
    pub(super) fn damaged_session(
        &self,
        rec: &SessionRecord,
        reason: String,
    ) -> ServiceResult<Session> {
        // A policy this build cannot read is shown as the bound's: the session is not served.
        let policy = rec.policy.policy().unwrap_or(Policy::bound(
            rec.policy.sink_blocks,
            rec.policy.local_blocks,
            rec.policy.top_k,
        ));
        let kv = KvCache::new_with(geometry_of(&rec.geometry)?, self.arena.clone(), false)?;
        let mut s = Session::restored(rec, policy, kv, Durable::Nvme(rec.layer_tokens.clone()));
        s.damaged = Some(reason);
        Ok(s)
    }

    pub(super) fn restore(
        &self,
        tier: &NvmeTier,
        t: &TierSettings,
        rec: &SessionRecord,
    ) -> ServiceResult<Session> {
        // Every run, read in batches sized by the devices' tracked rates; the next batch is
        // read and verified while this one is rebuilt (on the store's workers).
        let (rb, mut kv) = self.rebuild(rec)?;
        let wanted = &rb.wanted;
        let workers = tier.store().workers();
        tier.read_runs_pipelined(rec.id, wanted, |r, pages| -> ServiceResult<()> {
            // Block by block, a block stays resident while the host tier is below low water
            // (bytes_used < bytes_total * low_water) and each kept block takes one extent of
            // the session's run size: so the first `room` blocks of the batch are kept, the
            // same blocks as block by block.
            // Nothing else allocates extents during recovery (it runs before the socket
            // opens); if something did, the tier could pass low water by at most one batch
            // (PIPELINE_BATCH_BYTES of pages, at most BULK_BATCH_MAX_PAGES blocks).
            let u = self.arena.usage();
            let low = (u.bytes_total as f64 * t.low_water).ceil() as usize;
            let mut room = low
                .saturating_sub(u.bytes_used)
                .div_ceil(kv.run_extent_bytes());
            // The blocks before the first page that failed are restored first, so the error
            // is the one block-by-block restoring would meet first.
            let ok = pages.iter().position(Result::is_err).unwrap_or(pages.len());
            let blocks: Vec<StoredBlock<'_>> = pages[..ok]
                .iter()
                .zip(&wanted[r.start..r.start + ok])
                .map(|(page, &(l, b))| {
                    let keep = room > 0;
                    room -= keep as usize;
                    StoredBlock {
                        layer: l,
                        run: page.as_ref().expect("before the first failure").payload(),
                        valid: rb.valid(l, b),
                        keep,
                    }
                })
                .collect();
            kv.restore_blocks(&blocks, workers)?;
            match pages.into_iter().nth(ok) {
                Some(Err(e)) => Err(nvme_error(e)),
                _ => Ok(()),
            }
        })?;
        let persisted = (0..kv.geometry().layers)
            .map(|l| kv.tokens(l).expect("layer"))
            .collect();
        Ok(Session::restored(
            rec,
            rb.policy,
            kv,
            Durable::Nvme(persisted),
        ))
    }
}
