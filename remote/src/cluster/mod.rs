//! [`ClusterStore`]: the remote tier on a Redis Cluster (keys and write order: the crate docs).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvtier_storage::nvme::manifest::SessionRecord;
use kvtier_storage::nvme::{page, refuse_runs, PageId};
use parking_lot::Mutex;
use redis::cluster::{cluster_pipe, ClusterClient, ClusterConnection};
use redis::cluster_routing::{
    AggregateOp, MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo,
    SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Script, Value};

use crate::{Claim, RemoteError, RemotePage, RemoteRecord, RemoteRun, RemoteStore, Result, Write};

mod read;
mod wire;
use read::Part;
use wire::*;

/// How to reach the cluster and what a write waits for (`[remote]` in tierd's config).
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Seed nodes, `redis://host:port` each; the client learns the rest of the cluster.
    pub seeds: Vec<String>,
    /// Prefix of every key (several deployments can share a cluster).
    pub key_prefix: String,
    pub connect_timeout: Duration,
    /// How long one request may wait for its answer.
    pub response_timeout: Duration,
    /// How long a claim lasts unless renewed.
    pub claim_ttl: Duration,
    /// Replicas of each master that must acknowledge a write before it counts (Redis `WAIT`);
    /// 0: a master's acknowledgement.
    pub replicas: u32,
    /// How long a write waits for those acknowledgements.
    pub replica_timeout: Duration,
    /// Page bytes per pipeline of a bulk write or read.
    pub batch_bytes: usize,
    /// Connections a bulk write or read uses at once.
    pub streams: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            seeds: Vec::new(),
            key_prefix: "kvtier".into(),
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
            claim_ttl: Duration::from_secs(10),
            replicas: 1,
            replica_timeout: Duration::from_secs(2),
            batch_bytes: 16 << 20,
            streams: 4,
        }
    }
}

/// A claim's local validity is its TTL less this share, for clock drift between the node
/// and the store.
const DRIFT: f64 = 0.1;

/// The masters a write waits for replicas on.
#[derive(Clone, Copy)]
enum Masters<'a> {
    /// The master of this key's slot (one session's hash-tagged keys).
    Of(&'a str),
    /// Every master.
    All,
}

/// The remote tier on a Redis Cluster.
pub struct ClusterStore {
    client: ClusterClient,
    cfg: ClusterConfig,
    /// Idle connections (a cluster connection serves one caller at a time).
    idle: Mutex<Vec<ClusterConnection>>,
    scripts: Scripts,
}

impl std::fmt::Debug for ClusterStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterStore")
            .field("seeds", &self.cfg.seeds)
            .field("key_prefix", &self.cfg.key_prefix)
            .finish()
    }
}

impl ClusterStore {
    /// Connects to the cluster (the first connection is made here, so a wrong seed list fails
    /// at start, not at the first write).
    pub fn connect(cfg: ClusterConfig) -> Result<Self> {
        if cfg.seeds.is_empty() {
            return Err(RemoteError::Invalid("remote.seeds is empty".into()));
        }
        let client = ClusterClient::builder(cfg.seeds.clone())
            .connection_timeout(cfg.connect_timeout)
            .response_timeout(cfg.response_timeout)
            .build()?;
        let store = ClusterStore {
            client,
            cfg,
            idle: Mutex::new(Vec::new()),
            scripts: Scripts {
                claim: Script::new(CLAIM),
                renew: Script::new(RENEW),
                give_up: Script::new(GIVE_UP),
                begin: Script::new(BEGIN),
                commit: Script::new(COMMIT),
                cleared: Script::new(CLEARED),
                delete: Script::new(DELETE),
            },
        };
        store.query::<String>(&redis::cmd("PING"))?;
        Ok(store)
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    /// Runs `f` on an idle connection (a new one if none is idle). A connection whose
    /// request failed is dropped, not reused. Redis acknowledges replication per connection
    /// (`WAIT`), so a write and its wait go in one `f`.
    fn with<T>(&self, f: impl FnOnce(&mut ClusterConnection) -> Result<T>) -> Result<T> {
        let taken = self.idle.lock().pop();
        let mut con = match taken {
            Some(c) => c,
            None => self.client.get_connection()?,
        };
        let r = f(&mut con);
        if r.is_ok() {
            self.idle.lock().push(con);
        }
        r
    }

    /// One command on an idle connection.
    fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        self.with(|c| Ok(cmd.query(c)?))
    }

    /// Runs `each(connection, i)` for batches `0..n` on up to `streams` connections at once,
    /// each on a thread of its own with one connection for all its batches, then `finish` on
    /// that connection (a write's `WAIT`). Results in batch order, or the first error.
    fn in_streams<T: Send>(
        &self,
        n: usize,
        each: impl Fn(&mut ClusterConnection, usize) -> Result<T> + Sync,
        finish: impl Fn(&mut ClusterConnection) -> Result<()> + Sync,
    ) -> Result<Vec<T>> {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let done: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
        let failed: Mutex<Option<RemoteError>> = Mutex::new(None);
        std::thread::scope(|scope| {
            for _ in 0..self.cfg.streams.clamp(1, n.max(1)) {
                scope.spawn(|| {
                    let r = self.with(|con| {
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if i >= n || failed.lock().is_some() {
                                break;
                            }
                            *done[i].lock() = Some(each(con, i)?);
                        }
                        finish(con)
                    });
                    if let Err(e) = r {
                        failed.lock().get_or_insert(e);
                    }
                });
            }
        });
        if let Some(e) = failed.into_inner() {
            return Err(e);
        }
        Ok(done
            .into_iter()
            .map(|d| d.into_inner().expect("every batch ran"))
            .collect())
    }

    fn tag(&self, session: u64) -> String {
        format!("{{{}:{}}}", self.cfg.key_prefix, session)
    }

    fn key(&self, session: u64, what: &str) -> String {
        format!("{}:{what}", self.tag(session))
    }

    fn page_key(&self, session: u64, layer: u32, block: u32, generation: u64) -> String {
        format!(
            "{}:page:{session}:{layer}:{block}:{generation}",
            self.cfg.key_prefix
        )
    }

    /// The key of a page's summary (beside the page, same generation).
    fn summary_key(&self, session: u64, layer: u32, block: u32, generation: u64) -> String {
        format!(
            "{}:sum:{session}:{layer}:{block}:{generation}",
            self.cfg.key_prefix
        )
    }

    fn index_key(&self) -> String {
        format!("{}:sessions", self.cfg.key_prefix)
    }

    fn claim_value(claim: &Claim) -> String {
        format!("{} {}", claim.token, claim.node)
    }

    /// Runs a claim-checked script: `Ok(reply)` when it ran (and, with `replicated`, once
    /// the replicas acknowledge it), [`RemoteError::Fenced`] when the claim was not the
    /// current one.
    fn checked(
        &self,
        claim: &Claim,
        script: &Script,
        keys: &[String],
        args: &[&[u8]],
        replicated: bool,
    ) -> Result<Vec<Value>> {
        let value = Self::claim_value(claim);
        let reply: Vec<Value> = self.with(|c| {
            let mut inv = script.prepare_invoke();
            for k in keys {
                inv.key(k);
            }
            inv.arg(value.as_bytes());
            for a in args {
                inv.arg(*a);
            }
            let reply: Vec<Value> = inv.invoke(c)?;
            if replicated && reply.first().and_then(int) == Some(1) {
                self.wait_replicas(c, Masters::Of(&keys[0]))?;
            }
            Ok(reply)
        })?;
        if reply.first().and_then(int) == Some(1) {
            return Ok(reply);
        }
        Err(RemoteError::Fenced {
            session: claim.session,
            token: claim.token,
            holder: holder_of(reply.get(1)),
        })
    }

    /// Refuses locally a write under a claim this node can no longer be sure of.
    fn check_valid(claim: &Claim) -> Result<()> {
        if claim.is_valid() {
            Ok(())
        } else {
            Err(RemoteError::ClaimExpired {
                session: claim.session,
                token: claim.token,
            })
        }
    }

    fn valid_until(&self, asked: Instant) -> Instant {
        asked + self.cfg.claim_ttl.mul_f64(1.0 - DRIFT)
    }

    /// With `replicas > 0`: waits until `on` has that many replicas acknowledging what `c`
    /// wrote to it (`WAIT` over `c`'s connection to each of those masters; the fewest
    /// acknowledgements count). A script touches one session's hash tag, so it waits on that
    /// slot's master alone: a master left without replicas then stops only the sessions it
    /// holds, not every claim and renewal of the node.
    fn wait_replicas(&self, c: &mut ClusterConnection, on: Masters<'_>) -> Result<()> {
        let want = self.cfg.replicas;
        if want == 0 {
            return Ok(());
        }
        let mut wait = redis::cmd("WAIT");
        wait.arg(want)
            .arg(self.cfg.replica_timeout.as_millis() as u64);
        let routing = match on {
            Masters::Of(key) => RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                Route::with_key(key, SlotAddr::Master),
            )),
            Masters::All => RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::Aggregate(AggregateOp::Min)),
            )),
        };
        let got = c.route_command(&wait, routing)?;
        let got = int(&got).unwrap_or(0).max(0) as u32;
        if got < want {
            return Err(RemoteError::NotReplicated { wanted: want, got });
        }
        Ok(())
    }

    /// Deletes pages and their summaries, pipelined in batches.
    fn delete_pages(&self, session: u64, pages: &[(u32, u32, u64)]) -> Result<()> {
        for chunk in pages.chunks(512) {
            let mut p = cluster_pipe();
            for &(l, b, g) in chunk {
                p.del(self.page_key(session, l, b, g)).ignore();
                p.del(self.summary_key(session, l, b, g)).ignore();
            }
            self.with(|c| Ok(p.query::<()>(c)?))?;
        }
        Ok(())
    }

    /// Removes what interrupted writes left (the crate docs): pages of uncommitted
    /// generations the record does not name, and pages listed for deletion.
    fn clean_up(&self, claim: &Claim) -> Result<()> {
        let pending: Vec<(Vec<u8>, Vec<u8>)> =
            self.query(redis::cmd("HGETALL").arg(self.key(claim.session, "pending")))?;
        if pending.is_empty() {
            return Ok(());
        }
        let record = self.record(claim.session)?;
        let named: HashSet<(u32, u32, u64)> = record
            .iter()
            .flat_map(|r| r.pages.iter().map(|p| (p.layer, p.block, p.generation)))
            .collect();
        let mut fields = Vec::new();
        for (field, value) in &pending {
            let name = String::from_utf8_lossy(field).into_owned();
            let pages = if name.starts_with("del:") {
                unpack_pages(value)
            } else if let Ok(generation) = name.parse::<u64>() {
                unpack_runs(value, generation)
            } else {
                continue;
            };
            let orphans: Vec<_> = pages.into_iter().filter(|p| !named.contains(p)).collect();
            self.delete_pages(claim.session, &orphans)?;
            tracing::info!(session = claim.session, field = %name, pages = orphans.len(), "remote: removed what an interrupted write left");
            fields.push(field.clone());
        }
        let args: Vec<&[u8]> = fields.iter().map(Vec::as_slice).collect();
        self.checked(
            claim,
            &self.scripts.cleared,
            &[
                self.key(claim.session, "claim"),
                self.key(claim.session, "pending"),
            ],
            &args,
            false,
        )?;
        Ok(())
    }
}

impl RemoteStore for ClusterStore {
    fn claim(&self, session: u64, node: &str) -> Result<Claim> {
        if node.is_empty() || node.contains(' ') {
            return Err(RemoteError::Invalid(format!(
                "node name {node:?}: must be non-empty, without spaces"
            )));
        }
        let asked = Instant::now();
        let reply: Vec<Value> = self.with(|c| {
            let reply: Vec<Value> = self
                .scripts
                .claim
                .key(self.key(session, "claim"))
                .key(self.key(session, "fence"))
                .arg(node)
                .arg(self.cfg.claim_ttl.as_millis() as u64)
                .invoke(c)?;
            // The claim and its token on the replicas before anyone relies on them: a
            // failover must not hand the session, or the same token, to a second node.
            if reply.first().and_then(int) == Some(1) {
                self.wait_replicas(c, Masters::Of(&self.key(session, "claim")))?;
            }
            Ok(reply)
        })?;
        if reply.first().and_then(int) != Some(1) {
            return Err(RemoteError::Owned {
                session,
                owner: reply.get(1).and_then(text).unwrap_or_default(),
                expires_ms: reply.get(2).and_then(int).unwrap_or(0),
            });
        }
        let token = reply.get(1).and_then(int).unwrap_or(0) as u64;
        let claim = Claim {
            session,
            node: node.to_string(),
            token,
            valid_until: self.valid_until(asked),
        };
        self.clean_up(&claim)?;
        Ok(claim)
    }

    fn renew(&self, claim: &mut Claim) -> Result<()> {
        let asked = Instant::now();
        let ttl = (self.cfg.claim_ttl.as_millis() as u64).to_string();
        self.checked(
            claim,
            &self.scripts.renew,
            &[
                self.key(claim.session, "claim"),
                self.key(claim.session, "fence"),
            ],
            &[ttl.as_bytes()],
            // The extension on the replicas too: a failover must not bring back the shorter
            // one, letting another node claim the session while this one relies on it.
            true,
        )?;
        claim.valid_until = self.valid_until(asked);
        Ok(())
    }

    fn give_up(&self, claim: &Claim) -> Result<()> {
        match self.checked(
            claim,
            &self.scripts.give_up,
            &[
                self.key(claim.session, "claim"),
                self.key(claim.session, "fence"),
            ],
            &[],
            false,
        ) {
            Ok(_) | Err(RemoteError::Fenced { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn owner(&self, session: u64) -> Result<Option<String>> {
        let v: Value = self.query(redis::cmd("GET").arg(self.key(session, "claim")))?;
        Ok(holder_of(Some(&v)))
    }

    fn begin(&self, claim: &Claim, meta: &SessionRecord, runs: &[(u32, u32)]) -> Result<Write> {
        if meta.id != claim.session {
            return Err(RemoteError::Invalid(format!(
                "a claim of session {} cannot write session {}",
                claim.session, meta.id
            )));
        }
        if let Some(why) = refuse_runs(meta.id, meta.geometry.layers, runs.iter().copied()) {
            return Err(RemoteError::Invalid(why));
        }
        Self::check_valid(claim)?;
        let id = meta.id;
        let previous = self.record(id)?;
        // Listed before anything is written: resuming nodes find the session by it.
        self.query::<()>(redis::cmd("SADD").arg(self.index_key()).arg(id))?;
        let packed = pack_runs(runs.iter().copied());
        let reply = self.checked(
            claim,
            &self.scripts.begin,
            &[
                self.key(id, "claim"),
                self.key(id, "gen"),
                self.key(id, "pending"),
            ],
            &[&packed],
            false,
        )?;
        Ok(Write {
            claim: claim.clone(),
            meta: meta.clone(),
            generation: reply.get(1).and_then(int).unwrap_or(0) as u64,
            previous,
            begun: runs.len(),
            unwritten: runs.iter().copied().collect(),
            written: Vec::with_capacity(runs.len()),
        })
    }

    fn write(&self, w: &mut Write, runs: &[RemoteRun<'_>]) -> Result<()> {
        let (id, generation) = (w.meta.id, w.generation);
        // Each run is taken off the unwritten set; one not on it was not begun or is written
        // twice (the write is then refused, and must be begun again).
        if let Some(r) = runs
            .iter()
            .find(|r| !w.unwritten.remove(&(r.layer, r.block)))
        {
            return Err(RemoteError::Invalid(format!(
                "session {id}: (layer {}, block {}) was not begun, or is written twice",
                r.layer, r.block
            )));
        }
        if runs.is_empty() {
            return Ok(()); // nothing to store, nothing to wait for
        }
        // The pages and their summaries, in pipelines of about `batch_bytes` on several
        // connections, each connection waiting for its replicas once its pipelines are
        // written.
        let cut = batches(
            runs.iter().map(|r| r.bytes.len() + r.summary.len()),
            self.cfg.batch_bytes,
        );
        let written: Vec<Vec<RemotePage>> = self.in_streams(
            cut.len(),
            |c, b| {
                let mut p = cluster_pipe();
                let mut pages = Vec::with_capacity(cut[b].len());
                for r in &runs[cut[b].clone()] {
                    let pid = PageId {
                        session: id,
                        layer: r.layer,
                        block: r.block,
                        generation,
                    };
                    let encoded = |bytes: &[u8]| {
                        let mut buf = vec![0u8; page::HEADER_LEN + bytes.len()];
                        let crc = page::encode(&mut buf, pid, bytes);
                        (buf, crc)
                    };
                    let (page, crc) = encoded(r.bytes);
                    let (summary, summary_crc) = encoded(r.summary);
                    p.set(self.page_key(id, r.layer, r.block, generation), page)
                        .ignore();
                    p.set(self.summary_key(id, r.layer, r.block, generation), summary)
                        .ignore();
                    pages.push(RemotePage {
                        layer: r.layer,
                        block: r.block,
                        generation,
                        crc,
                        payload_len: r.bytes.len() as u32,
                        summary_crc,
                        summary_len: r.summary.len() as u32,
                    });
                }
                p.query::<()>(c)?;
                Ok(pages)
            },
            // Pages spread over every slot, so over every master.
            |c| self.wait_replicas(c, Masters::All),
        )?;
        w.written.extend(written.into_iter().flatten());
        Ok(())
    }

    fn commit(&self, w: Write) -> Result<u64> {
        let Write {
            claim,
            meta,
            generation,
            previous,
            begun,
            unwritten: _,
            written,
        } = w;
        let id = meta.id;
        // By count, not by what is left unwritten: a refused write took its runs off that set.
        if written.len() != begun {
            return Err(RemoteError::Invalid(format!(
                "session {id}: {} of the {begun} runs begun were written",
                written.len()
            )));
        }
        // The new record: the previous pages but those rewritten, and the new ones.
        let rewritten: HashSet<(u32, u32)> = written.iter().map(|p| (p.layer, p.block)).collect();
        let mut superseded = Vec::new();
        let mut pages = Vec::with_capacity(written.len());
        for p in previous.iter().flat_map(|r| r.pages.iter()) {
            if rewritten.contains(&(p.layer, p.block)) {
                superseded.push((p.layer, p.block, p.generation));
            } else {
                pages.push(*p);
            }
        }
        pages.extend(written);
        pages.sort_by_key(|p| (p.layer, p.block));
        let record = RemoteRecord {
            session: SessionRecord {
                pages: Vec::new(),
                ..meta
            },
            pages,
            generation,
        };
        // No local validity check here: a write longer than the claim is kept alive by the
        // node's renewals, and the commit is fenced in the store whatever this copy says.
        let gen_field = generation.to_string();
        let superseded_packed = pack_pages(superseded.iter().copied());
        self.checked(
            &claim,
            &self.scripts.commit,
            &[
                self.key(id, "claim"),
                self.key(id, "record"),
                self.key(id, "pending"),
            ],
            &[gen_field.as_bytes(), &record.encode(), &superseded_packed],
            true,
        )?;

        // Committed: what is left is clean-up, which the next owner redoes if this fails.
        if !superseded.is_empty() {
            let cleaned = self.delete_pages(id, &superseded).and_then(|()| {
                let field = format!("del:{generation}");
                self.checked(
                    &claim,
                    &self.scripts.cleared,
                    &[self.key(id, "claim"), self.key(id, "pending")],
                    &[field.as_bytes()],
                    false,
                )
            });
            if let Err(e) = cleaned {
                tracing::warn!(session = id, error = %e, "remote: superseded pages left for the next owner to remove");
            }
        }
        Ok(generation)
    }

    fn record(&self, session: u64) -> Result<Option<RemoteRecord>> {
        let bytes: Option<Vec<u8>> =
            self.query(redis::cmd("GET").arg(self.key(session, "record")))?;
        bytes.map(|b| RemoteRecord::decode(session, &b)).transpose()
    }

    fn read_runs(&self, record: &RemoteRecord, wanted: &[(u32, u32)]) -> Result<Vec<Vec<u8>>> {
        self.read_parts(record, wanted, Part::Page)
    }

    fn read_summaries(&self, record: &RemoteRecord, wanted: &[(u32, u32)]) -> Result<Vec<Vec<u8>>> {
        self.read_parts(record, wanted, Part::Summary)
    }

    fn delete_session(&self, claim: &Claim) -> Result<()> {
        Self::check_valid(claim)?;
        let id = claim.session;
        let Some(record) = self.record(id)? else {
            return Ok(());
        };
        let pages: Vec<_> = record
            .pages
            .iter()
            .map(|p| (p.layer, p.block, p.generation))
            .collect();
        let packed = pack_pages(pages.iter().copied());
        self.checked(
            claim,
            &self.scripts.delete,
            &[
                self.key(id, "claim"),
                self.key(id, "record"),
                self.key(id, "pending"),
            ],
            &[&packed],
            true,
        )?;
        self.delete_pages(id, &pages)?;
        self.checked(
            claim,
            &self.scripts.cleared,
            &[self.key(id, "claim"), self.key(id, "pending")],
            &[b"del:all"],
            false,
        )?;
        self.query::<()>(redis::cmd("SREM").arg(self.index_key()).arg(id))?;
        Ok(())
    }

    fn session_ids(&self) -> Result<Vec<u64>> {
        let mut ids: Vec<u64> = self.query(redis::cmd("SMEMBERS").arg(self.index_key()))?;
        ids.sort_unstable();
        Ok(ids)
    }
}
