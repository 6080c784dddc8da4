//! The remote tier's policy (`[remote]`): which sessions this node claims, OFFLOAD, resuming a
//! session another node wrote, write-through and periodic writes to the cluster, renewing
//! claims, and shutdown.
//!
//! A session this node writes to the cluster is claimed first (`kvtier_remote`: one node owns
//! a session at a time, fenced by a token). A request naming a session this node does not hold
//! looks in the cluster: if the session is there and no other node claims it, it is claimed,
//! read back (every page verified) and served from then on. While a claim cannot be renewed
//! (the node is cut off from the cluster), its sessions' appends and decodes are refused with
//! UNAVAILABLE rather than run where they might race a new owner; if another node took the
//! session meanwhile, this node drops its copy.

use kvtier_remote::{Claim, RemoteError, RemoteRun, RemoteStore};

use super::*;

/// How the service uses the remote tier.
pub struct Remote {
    pub(super) store: Arc<dyn RemoteStore>,
    /// This node's name in claims.
    node: String,
    /// Acknowledge appends only once they are in the cluster.
    write_through: bool,
    /// How often unpinned sessions are written to the cluster (None: never), and when last.
    flush: Option<(Duration, Mutex<Instant>)>,
    /// The claims this node holds, by session.
    claims: Mutex<HashMap<u64, Claim>>,
    /// Resume from block summaries, runs on demand (else read every page first).
    from_summaries: bool,
    /// Stream a session resumed from its summaries in behind its steps.
    pub(super) stream_resumed: bool,
    /// One resume at a time: two requests naming one session claim it once.
    resuming: Mutex<()>,
}

impl Remote {
    /// `flush_every`: how often unpinned sessions are written to the cluster (None: only at
    /// OFFLOAD and shutdown).
    pub fn new(
        store: Arc<dyn RemoteStore>,
        node: String,
        write_through: bool,
        flush_every: Option<Duration>,
        from_summaries: bool,
        stream_resumed: bool,
    ) -> Self {
        Remote {
            store,
            node,
            write_through,
            flush: flush_every.map(|d| (d, Mutex::new(Instant::now()))),
            claims: Mutex::new(HashMap::new()),
            from_summaries,
            stream_resumed,
            resuming: Mutex::new(()),
        }
    }

    /// Sessions this node claims now.
    pub fn claims_held(&self) -> usize {
        self.claims.lock().len()
    }

    /// The claim on `id`, taken now if this node holds none.
    fn claim(&self, id: u64) -> ServiceResult<Claim> {
        if let Some(c) = self.claims.lock().get(&id) {
            return Ok(c.clone());
        }
        let c = self.store.claim(id, &self.node).map_err(remote_error)?;
        self.claims.lock().insert(id, c.clone());
        Ok(c)
    }

    /// Gives the claim on `id` up, if this node holds one.
    pub(super) fn give_up(&self, id: u64) {
        if let Some(c) = self.claims.lock().remove(&id) {
            if let Err(e) = self.store.give_up(&c) {
                tracing::warn!(session = id, error = %e, "remote: giving a claim up failed; it lapses by itself");
            }
        }
    }
}

/// The summaries of `blocks`, as the cluster keeps them beside their pages.
fn summaries_of(
    kv: &KvCache,
    blocks: impl IntoIterator<Item = (u32, u32)>,
) -> ServiceResult<Vec<Vec<u8>>> {
    blocks
        .into_iter()
        .map(|(l, b)| Ok(kv.block_summary(l, b)?))
        .collect()
}

/// Runs per batch of a resume's pull, and of cold runs read back for a write to the cluster
/// (32 MiB of Qwen2.5-7B's 256 KiB runs).
const BATCH_RUNS: usize = 128;

pub(super) fn remote_error(e: RemoteError) -> ServiceError {
    let code = match &e {
        // The owner's name alone, for a client to go there (protocol.md §3).
        RemoteError::Owned { owner, .. } => {
            return ServiceError::new(ErrorCode::OwnedElsewhere, owner.clone())
        }
        RemoteError::Fenced {
            holder: Some(h), ..
        } => return ServiceError::new(ErrorCode::OwnedElsewhere, h.clone()),
        // The claim lapsed and no node holds it now: nothing was written, and the next
        // renewal either takes it back (no claim issued since) or drops this copy (one was);
        // a retry is answered either way (protocol.md, OFFLOAD: UNAVAILABLE, session kept).
        RemoteError::Fenced { holder: None, .. }
        | RemoteError::Unavailable(_)
        | RemoteError::ClaimExpired { .. }
        | RemoteError::NotReplicated { .. } => ErrorCode::Unavailable,
        e if e.is_data_loss() => ErrorCode::DataLoss,
        _ => ErrorCode::Internal,
    };
    ServiceError::new(code, format!("remote tier: {e}"))
}

impl Service {
    /// Uses `remote` for its sessions from now on (its series registered in the metrics given
    /// before, [`Service::with_metrics`]).
    pub fn with_remote(mut self, remote: Remote) -> Self {
        self.remote = Some(remote);
        self.remote_metrics = Some(self.metrics.register_remote());
        self
    }

    /// Refuses to serve a session whose claim this node can no longer be sure of (its renewal
    /// has not reached the cluster within the claim's time).
    pub(super) fn check_claim(&self, id: u64) -> ServiceResult<()> {
        let Some(r) = &self.remote else {
            return Ok(());
        };
        match r.claims.lock().get(&id) {
            Some(c) if !c.is_valid() => Err(ServiceError::new(
                ErrorCode::Unavailable,
                format!(
                    "session {id}: this node's claim (node {}, token {}) could not be renewed in the remote tier; not serving it until it is (cut off from the cluster?)",
                    r.node, c.token
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Writes what the cluster's copy of the session lacks (blocks past its watermark) under
    /// this node's claim; returns the blocks written.
    pub(super) fn put_remote_locked(
        &self,
        r: &Remote,
        s: &Session,
        st: &mut SessionState,
    ) -> ServiceResult<u64> {
        let claim = r.claim(s.id)?;
        let wanted = tiering::dirty_blocks(&s.geometry, &st.kv, &st.remote_persisted)?;
        let record = tiering::record_of(s, &st.kv);
        let mut w = r
            .store
            .begin(&claim, &record, &wanted)
            .map_err(remote_error)?;
        let mut bytes = 0;
        // Cold runs (demoted to NVMe) are read back batch by batch, never the whole session
        // at once; resident ones are borrowed.
        let (mut cold, mut resident) = (Vec::new(), Vec::new());
        for &(l, b) in &wanted {
            match st.kv.run(l, b) {
                Some(run) => resident.push((l, b, run)),
                None => cold.push((l, b)),
            }
        }
        if !cold.is_empty() {
            let (tier, _) = self
                .tier
                .as_ref()
                .ok_or_else(|| ServiceError::internal("cold blocks without an NVMe tier"))?;
            for batch in cold.chunks(BATCH_RUNS) {
                let pages = tier
                    .read_runs(s.id, batch)
                    .map_err(nvme_error)?
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(nvme_error)?;
                let summaries = summaries_of(&st.kv, batch.iter().copied())?;
                let runs: Vec<RemoteRun<'_>> = batch
                    .iter()
                    .zip(&pages)
                    .zip(&summaries)
                    .map(|((&(layer, block), page), summary)| RemoteRun {
                        layer,
                        block,
                        bytes: page.payload(),
                        summary,
                    })
                    .collect();
                bytes += runs.iter().map(|r| r.bytes.len()).sum::<usize>();
                r.store.write(&mut w, &runs).map_err(remote_error)?;
            }
        }
        let summaries = summaries_of(&st.kv, resident.iter().map(|&(l, b, _)| (l, b)))?;
        let resident: Vec<RemoteRun<'_>> = resident
            .iter()
            .zip(&summaries)
            .map(|(&(layer, block, bytes), summary)| RemoteRun {
                layer,
                block,
                bytes,
                summary,
            })
            .collect();
        bytes += resident.iter().map(|r| r.bytes.len()).sum::<usize>();
        r.store.write(&mut w, &resident).map_err(remote_error)?;
        r.store.commit(w).map_err(remote_error)?;
        st.remote_persisted = record.layer_tokens;
        if let Some(a) = &st.arriving {
            a.written(&wanted);
        }
        self.counters
            .remote_blocks_written
            .fetch_add(wanted.len() as u64, Ordering::Relaxed);
        self.counters
            .remote_bytes_written
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(wanted.len() as u64)
    }

    /// The end of an append to a session this node claims, with `remote.write_through`: its
    /// tokens go to the cluster before the reply.
    pub(super) fn append_through_remote(
        &self,
        s: &Session,
        st: &mut SessionState,
    ) -> ServiceResult<()> {
        match &self.remote {
            Some(r) if r.write_through => self.put_remote_locked(r, s, st).map(|_| ()),
            _ => Ok(()),
        }
    }

    /// OFFLOAD: writes the session to the cluster, gives this node's claim up and drops the
    /// session here (its NVMe copy too); any node resumes it when asked for it.
    pub fn offload(&self, peer: &Peer, id: u64) -> ServiceResult<u64> {
        let r = self.remote.as_ref().ok_or_else(|| {
            ServiceError::precondition("the remote tier is not enabled (remote.enabled)")
        })?;
        let s = self.lookup_live(peer, id)?;
        if s.pinned.load(Ordering::Relaxed) {
            return Err(ServiceError::precondition(format!(
                "session {id} is pinned to this node; UNPIN it first"
            )));
        }
        let blocks = self.offload_session(r, &s)?;
        self.counters
            .remote_offloads
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(session = id, blocks, "session offloaded to the remote tier");
        Ok(blocks)
    }

    /// Writes what the cluster's copy of `s` lacks, then drops the session here: its NVMe copy
    /// (the cluster is its home now), its table entry, its device state, the claim.
    fn offload_session(&self, r: &Remote, s: &Session) -> ServiceResult<u64> {
        let id = s.id;
        let mut st = s.state.lock();
        if st.closed {
            return Err(ServiceError::not_found(id));
        }
        s.check_unleased("offloading it")?;
        let blocks = self.put_remote_locked(r, s, &mut st)?;
        self.forget_locked(s, &mut st)?;
        drop(st);
        self.gpu_close(id);
        r.give_up(id);
        Ok(blocks)
    }

    /// The session `id` from the cluster, claimed and restored here, if the cluster holds it
    /// and `peer` may see it (None otherwise: NOT_FOUND, as for any other uid's session).
    pub(super) fn resume(
        &self,
        peer: &Peer,
        id: u64,
        admin_ok: bool,
    ) -> ServiceResult<Option<Arc<Session>>> {
        let Some(r) = &self.remote else {
            return Ok(None);
        };
        let _one = r.resuming.lock();
        if let Some(s) = self.sessions.read().get(&id) {
            return Ok(Some(s.clone()));
        }
        let visible = |owner: u32| owner == peer.uid || (admin_ok && self.is_admin(peer));
        // Seen before claimed, so a uid cannot take another's session from its node.
        match r.store.record(id).map_err(remote_error)? {
            Some(rec) if visible(rec.session.owner_uid) => {}
            _ => return Ok(None),
        }
        let claim = r.claim(id)?;
        // Read again under the claim: what the last owner committed.
        let restored = r.store.record(id).map_err(remote_error).and_then(|rec| {
            let rec = rec.ok_or_else(|| ServiceError::not_found(id))?;
            if r.from_summaries && rec.has_summaries() {
                self.restore_summaries(r, rec)
            } else {
                self.restore_remote(r, &rec)
            }
        });
        let session = match restored {
            Ok(s) => Arc::new(s),
            Err(e) => {
                r.give_up(id);
                return Err(e);
            }
        };
        {
            let mut table = self.sessions.write();
            if table.len() >= self.limits.max_sessions {
                drop(table);
                r.give_up(id);
                self.record_rejection(Rejection::SessionLimit);
                return Err(ServiceError::exhausted(format!(
                    "session limit reached ({} sessions; admission.max_sessions)",
                    self.limits.max_sessions
                )));
            }
            table.insert(id, session.clone());
        }
        self.gpu_open(id, &session.geometry, &session.policy);
        self.counters.remote_resumes.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            session = id,
            token = claim.token,
            tokens = session.state.lock().kv.max_tokens_stored(),
            "session resumed from the remote tier"
        );
        Ok(Some(session))
    }

    /// Rebuilds a session from its cluster record: every page read back (verified) and kept
    /// in the host tier, tiles and bounds rebuilt as a warm restart does.
    fn restore_remote(
        &self,
        r: &Remote,
        rec: &kvtier_remote::RemoteRecord,
    ) -> ServiceResult<Session> {
        let meta = &rec.session;
        let (rb, mut kv) = self.rebuild(meta)?;
        let workers = kvtier_storage::default_workers();
        // In batches of runs, the next read from the cluster while this one is rebuilt: at
        // most three batches' bytes held at once (one read, one queued, one rebuilt).
        let batches: Vec<&[(u32, u32)]> = rb.wanted.chunks(BATCH_RUNS).collect();
        std::thread::scope(|scope| -> ServiceResult<()> {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let reader = scope.spawn(move || {
                for &chunk in &batches {
                    let pages = r.store.read_runs(rec, chunk).map_err(remote_error);
                    let failed = pages.is_err();
                    if tx.send((chunk, pages)).is_err() || failed {
                        break;
                    }
                }
            });
            let mut rebuilt = Ok(());
            for (chunk, pages) in rx {
                let pages = match pages {
                    Ok(p) => p,
                    Err(e) => {
                        rebuilt = Err(e);
                        break;
                    }
                };
                self.counters.read_from_remote(&pages);
                let blocks: Vec<StoredBlock<'_>> = pages
                    .iter()
                    .zip(chunk)
                    .map(|(run, &(l, b))| StoredBlock {
                        layer: l,
                        run,
                        valid: rb.valid(l, b),
                        keep: true,
                    })
                    .collect();
                if let Err(e) = kv.restore_blocks(&blocks, workers) {
                    rebuilt = Err(e.into());
                    break;
                }
            }
            // Dropping the receiver (above) stops the reader at its next batch.
            reader
                .join()
                .map_err(|_| ServiceError::internal("the resume's reader panicked"))?;
            rebuilt
        })?;
        Ok(Session::restored(meta, rb.policy, kv, Durable::Remote))
    }

    /// After a warm restart: a session the cluster holds is the cluster's, whatever this
    /// node's NVMe copy says (another node may have resumed and extended it since; tokens
    /// this node appended without write-through after its last write to the cluster are the
    /// documented cost of running without it). Such local copies are dropped, NVMe pages
    /// included; the next request resumes the session from the cluster. Returns the sessions
    /// dropped and those that could not be checked (kept, with a warning).
    pub fn defer_to_remote(&self) -> (usize, usize) {
        let Some(r) = &self.remote else {
            return (0, 0);
        };
        let ids: Vec<u64> = self.sessions.read().keys().copied().collect();
        let (mut dropped, mut unchecked) = (0, 0);
        for id in ids {
            match r.store.record(id) {
                Ok(None) => {}
                Ok(Some(_)) | Err(RemoteError::CorruptRecord { .. }) => {
                    if !self.drop_stale(id) {
                        continue;
                    }
                    dropped += 1;
                    tracing::info!(session = id, "remote: the cluster holds this session; the local copy is dropped (resumed from the cluster on its next request)");
                }
                Err(e) => {
                    unchecked += 1;
                    tracing::warn!(session = id, error = %e, "remote: could not check whether the cluster holds this session; serving the local copy");
                }
            }
        }
        (dropped, unchecked)
    }

    /// Drops this node's copy of a session the cluster holds for another node, or holds newer:
    /// never served again here, even if its NVMe copy cannot be deleted (a restart then drops
    /// it again, [`Service::defer_to_remote`]). Returns whether the node held it.
    fn drop_stale(&self, id: u64) -> bool {
        let Some(s) = self.sessions.read().get(&id).cloned() else {
            return false;
        };
        let mut st = s.state.lock();
        if let Err(e) = self.forget_locked(&s, &mut st) {
            tracing::warn!(session = id, error = %e, "remote: the NVMe copy of a session the cluster holds could not be deleted");
            st.closed = true;
            self.sessions.write().remove(&id);
        }
        drop(st);
        self.gpu_close(id);
        true
    }

    /// CLOSE/EVICT of a session this node claims: its cluster copy goes too.
    pub(super) fn remove_remote(&self, id: u64) -> ServiceResult<()> {
        let Some(r) = &self.remote else {
            return Ok(());
        };
        let Some(claim) = r.claims.lock().get(&id).cloned() else {
            return Ok(());
        };
        r.store.delete_session(&claim).map_err(remote_error)?;
        r.give_up(id);
        Ok(())
    }

    /// [`Service::flush_remote`], when `remote.flush_interval_ms` has passed since the last
    /// (tierd calls it every third of the claim time, on a thread of its own).
    pub fn flush_if_due(&self) {
        let due = self
            .remote
            .as_ref()
            .and_then(|r| r.flush.as_ref())
            .is_some_and(|(every, last)| {
                let mut last = last.lock();
                let due = last.elapsed() >= *every;
                if due {
                    *last = Instant::now();
                }
                due
            });
        if due {
            self.flush_remote();
        }
    }

    /// Writes what the cluster lacks of every unpinned session this node holds (claiming
    /// those it has not written before); a busy session waits for the next round. Returns
    /// the sessions written.
    pub fn flush_remote(&self) -> usize {
        let Some(r) = &self.remote else {
            return 0;
        };
        let all: Vec<Arc<Session>> = self.sessions.read().values().cloned().collect();
        let mut written = 0;
        for s in all {
            if s.damaged.is_some() || s.pinned.load(Ordering::Relaxed) {
                continue;
            }
            let Some(mut st) = s.state.try_lock() else {
                continue;
            };
            let lacking = tiering::dirty_blocks(&s.geometry, &st.kv, &st.remote_persisted);
            if st.closed || lacking.is_ok_and(|d| d.is_empty()) {
                continue;
            }
            match self.put_remote_locked(r, &s, &mut st) {
                Ok(_) => written += 1,
                Err(e) => {
                    tracing::warn!(session = s.id, error = %e, "remote: periodic write failed; retried next round")
                }
            }
        }
        written
    }

    /// Renews every claim this node holds (tierd calls it every third of the claim time, on
    /// a thread of its own, apart from the writes of [`Service::flush_if_due`]); one that lapsed
    /// with no claim issued since is taken back. A session another node has claimed meanwhile
    /// is dropped here: its copy may be stale. Returns the sessions dropped.
    pub fn renew_claims(&self) -> usize {
        let Some(r) = &self.remote else {
            return 0;
        };
        // Whether the table still holds this very claim: one given up (OFFLOAD, CLOSE) or
        // replaced while its renewal was in flight must neither come back nor drop anything.
        let current = |m: &HashMap<u64, Claim>, c: &Claim| {
            m.get(&c.session).is_some_and(|h| h.token == c.token)
        };
        let held: Vec<Claim> = r.claims.lock().values().cloned().collect();
        let mut dropped = 0;
        for mut c in held {
            match r.store.renew(&mut c) {
                Ok(()) => {
                    let mut m = r.claims.lock();
                    if current(&m, &c) {
                        m.insert(c.session, c);
                    }
                }
                Err(e @ RemoteError::Fenced { .. }) => {
                    let was_held = {
                        let mut m = r.claims.lock();
                        current(&m, &c) && m.remove(&c.session).is_some()
                    };
                    if !was_held {
                        continue;
                    }
                    tracing::error!(session = c.session, error = %e, "remote: another node claimed the session since; dropping this node's copy");
                    self.counters
                        .remote_claims_lost
                        .fetch_add(1, Ordering::Relaxed);
                    dropped += self.drop_stale(c.session) as usize;
                }
                Err(e) => {
                    tracing::warn!(session = c.session, error = %e, "remote: claim not renewed; its session is refused once the claim lapses");
                }
            }
        }
        dropped
    }

    /// At shutdown: every unpinned session is offloaded (written to the cluster, dropped
    /// here, the claim given up), so another node can take it at once and no stale NVMe copy
    /// comes back at a restart. One that cannot be written, and a pinned one, stays for the
    /// NVMe tier to keep ([`Service::persist_all`]). Returns (offloaded, failed).
    pub fn offload_all(&self) -> (usize, usize) {
        let Some(r) = &self.remote else {
            return (0, 0);
        };
        let all: Vec<Arc<Session>> = self.sessions.read().values().cloned().collect();
        let (mut ok, mut failed) = (0, 0);
        for s in all {
            let id = s.id;
            if s.damaged.is_some() || s.pinned.load(Ordering::Relaxed) {
                continue;
            }
            match self.offload_session(r, &s) {
                Ok(_) => ok += 1,
                Err(e) => {
                    failed += 1;
                    tracing::error!(session = id, error = %e, "could not write the session to the remote tier at shutdown");
                }
            }
        }
        (ok, failed)
    }
}
