//! One session: its identity, policy and state (the KV cache, the tiers' watermarks).

use super::*;

/// One session: its identity, policy and state.
pub struct Session {
    pub id: u64,
    pub owner_uid: u32,
    pub label: String,
    pub geometry: Geometry,
    pub policy: Policy,
    pub created_unix_ms: u64,
    pub(super) last_access_unix_ms: AtomicU64,
    pub(super) pinned: std::sync::atomic::AtomicBool,
    /// Connections holding a LEASE (see `lease.rs`): while any does, no extent is freed.
    pub(super) leases: std::sync::atomic::AtomicU32,
    /// Why its stored data could not be read back at startup, if it could not. Such a session
    /// stays listed (SESSION_INFO, LIST: its manifest token counts) so the loss is visible;
    /// every use answers DATA_LOSS; CLOSE deletes its NVMe record and pages, which stay
    /// untouched until then.
    pub(super) damaged: Option<String>,
    pub(super) state: Mutex<SessionState>,
}

/// Where a restored session's copy is durable.
pub(super) enum Durable {
    /// On NVMe, holding these tokens per layer (a warm restart).
    Nvme(Vec<u64>),
    /// In the remote tier, as its record says (a resume).
    Remote,
}

pub(super) struct SessionState {
    pub(super) kv: KvCache,
    /// Tokens per layer whose blocks are durable on NVMe (blocks at or past
    /// `persisted / block_tokens` are dirty and never evicted).
    pub(super) persisted: Vec<u64>,
    /// The NVMe manifest holds a record of this session.
    pub(super) stored: bool,
    /// Tokens per layer the remote tier's copy holds (all 0 until it is first written).
    pub(super) remote_persisted: Vec<u64>,
    /// Blocks of a session resumed from the remote tier not yet read from it (`arrival.rs`).
    pub(super) arriving: Option<Arc<arrival::Arriving>>,
    /// Removed by CLOSE/EVICT; a request that looked it up before must not write it back.
    pub(super) closed: bool,
    /// An open in-place append (RESERVE .. COMMIT, `lease.rs`): while it is, the session takes
    /// no other append or decode.
    pub(super) reserved: Option<lease::Reservation>,
}

impl SessionState {
    /// Cuts `layer` (every layer: None) back to `tokens` after an append a tier could not
    /// take. Each tier's watermark comes down with it: a tier that took the tokens before
    /// another refused them holds rows the cache no longer has, written again with the next
    /// append.
    pub(super) fn roll_back(&mut self, layer: Option<usize>, tokens: u64) {
        let layers = match layer {
            Some(l) => l..l + 1,
            None => 0..self.persisted.len(),
        };
        for l in layers {
            self.kv.truncate_layer(l, tokens);
            self.persisted[l] = self.persisted[l].min(tokens);
            self.remote_persisted[l] = self.remote_persisted[l].min(tokens);
        }
    }
}

impl Session {
    /// Marks the session used now (an append or a decode): memory pressure demotes the least
    /// recently used first, so looking at a session (SESSION_INFO, PIN, ...) does not count.
    pub(super) fn used_now(&self) {
        self.last_access_unix_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// A session rebuilt from its record `rec` into `kv`, its copy durable in the tier
    /// `durable` names. Takes the creation time the record kept (a record of an older format
    /// has none: the session then counts as created at its restore).
    pub(super) fn restored(
        rec: &SessionRecord,
        policy: Policy,
        kv: KvCache,
        durable: Durable,
    ) -> Self {
        let nvme = matches!(durable, Durable::Nvme(_));
        let mut s = Session::new(rec.id, rec.owner_uid, rec.label.clone(), policy, kv, nvme);
        let st = s.state.get_mut();
        match durable {
            Durable::Nvme(persisted) => {
                st.persisted = persisted;
                s.pinned.store(rec.pinned, Ordering::Relaxed);
            }
            Durable::Remote => st.remote_persisted = rec.layer_tokens.clone(),
        }
        if rec.created_unix_ms > 0 {
            s.created_unix_ms = rec.created_unix_ms;
        }
        s
    }

    /// Runs `f` on the session's KV cache under its lock.
    pub(crate) fn with_kv<R>(&self, f: impl FnOnce(&mut KvCache) -> R) -> R {
        f(&mut self.state.lock().kv)
    }

    pub(super) fn new(
        id: u64,
        owner_uid: u32,
        label: String,
        policy: Policy,
        kv: KvCache,
        stored: bool,
    ) -> Self {
        let now = now_ms();
        let layers = kv.geometry().layers as usize;
        Session {
            id,
            owner_uid,
            label,
            geometry: *kv.geometry(),
            policy,
            created_unix_ms: now,
            last_access_unix_ms: AtomicU64::new(now),
            pinned: std::sync::atomic::AtomicBool::new(false),
            leases: std::sync::atomic::AtomicU32::new(0),
            damaged: None,
            state: Mutex::new(SessionState {
                kv,
                persisted: vec![0; layers],
                stored,
                remote_persisted: vec![0; layers],
                arriving: None,
                closed: false,
                reserved: None,
            }),
        }
    }
}
