//! kvtier's remote tier: sessions kept in a store shared by every node, so that a session
//! outlives the node that built it and resumes on any other.
//!
//! [`RemoteStore`] is what a node asks of such a store; [`ClusterStore`] implements it on a
//! Redis Cluster (an S3-style object store with conditional writes could implement it next).
//!
//! # What is stored
//!
//! - **Pages**: one (layer, block) run each, in the NVMe tier's checksummed page format
//!   (`kvtier_storage::nvme::page`: identity, generation, crc32c), so a page read from the
//!   cluster is verified exactly as one read from a disk. Each write of a session takes a new
//!   generation; a page's key names it, so a stale or half-written page can never pass for
//!   the one the record names.
//! - **Summaries**: beside each page, the block's summary (its key bounds and sketches,
//!   `KvCache::block_summary`, about 1.6% of a page, 18% with sketches) in the same checksummed
//!   format: what a node needs to select over a session before its pages arrive.
//! - **The record**: the session's manifest record (geometry, policy, tokens per layer, owner,
//!   label) and, for every (layer, block), the generation, checksum and length of its page
//!   and of its summary.
//!   A write is committed when its record is.
//! - **The claim**: which node owns the session now, with a fencing token (a *claim*, since
//!   in tierd a LEASE is an engine's hold on a session's host extents).
//!
//! # Ownership
//!
//! One node owns a session at a time: [`RemoteStore::claim`] takes a claim that expires
//! unless renewed and issues a fencing token larger than any issued before for that session.
//! Every write checks, inside the store and atomically with the write, that the claim it
//! holds is still the current one: a node whose claim expired (a pause, a partition) and was
//! taken over has its late writes refused ([`RemoteError::Fenced`]), and a node refuses
//! locally to write under a claim it can no longer be sure of ([`RemoteError::ClaimExpired`]).
//!
//! # A write, and what a crash leaves
//!
//! A write ([`RemoteStore::begin`], [`RemoteStore::write`], [`RemoteStore::commit`]): (1) *begin*: under the claim check, take a generation and
//! note the runs about to be written as pending; (2) the pages, pipelined and spread over the
//! cluster's hash slots; (3) with `replicas > 0`, wait until every master has that many
//! replicas acknowledging (Redis `WAIT`); (4) *commit*: under the claim check, replace the
//! record, clear the pending note and note the pages it stops referencing; (5) delete those.
//! A crash before (4) leaves pages no record names, listed as pending; one after (4), pages
//! to delete, listed too: the next owner removes both when it takes the claim
//! ([`RemoteStore::claim`]). Nothing the record names is deleted before the record stops
//! naming it.
//!
//! # Keys (Redis Cluster)
//!
//! With prefix `P` (`remote.key_prefix`), a session `ID` has `{P:ID}:claim`, `{P:ID}:fence`,
//! `{P:ID}:gen`, `{P:ID}:pending` and `{P:ID}:record`, all in one hash slot (the hash tag), so
//! each claim-checked step is one atomic script; its pages are `P:page:ID:LAYER:BLOCK:GEN`,
//! spread over every slot, each beside its summary `P:sum:ID:LAYER:BLOCK:GEN`. `P:sessions` lists the session ids stored.

mod cluster;
mod error;
mod record;

pub use cluster::{ClusterConfig, ClusterStore};
pub use error::{RemoteError, Result};
pub use record::{RemotePage, RemoteRecord};

use std::time::Instant;

use kvtier_storage::nvme::manifest::SessionRecord;

/// A node's ownership of one session, as [`RemoteStore::claim`] granted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub session: u64,
    /// The owning node's name (`remote.node`).
    pub node: String,
    /// The fencing token: larger than every token issued for this session before.
    pub token: u64,
    /// Until when this node may rely on the claim: its expiry measured from before the request
    /// that took or renewed it, less a margin for clock drift. Past it, writes are refused
    /// locally ([`RemoteError::ClaimExpired`]).
    pub valid_until: Instant,
}

impl Claim {
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until
    }
}

/// One (layer, block) run to store: its payload (the block run) and its summary
/// (`KvCache::block_summary`: what selection reads of the block, so that a node can decode
/// a session before its runs arrive).
#[derive(Debug, Clone, Copy)]
pub struct RemoteRun<'a> {
    pub layer: u32,
    pub block: u32,
    pub bytes: &'a [u8],
    pub summary: &'a [u8],
}

/// A write begun by [`RemoteStore::begin`], committed by [`RemoteStore::commit`].
#[derive(Debug)]
pub struct Write {
    claim: Claim,
    meta: SessionRecord,
    generation: u64,
    /// The committed record the write started from.
    previous: Option<RemoteRecord>,
    /// Runs begun, and those not yet stored.
    begun: usize,
    unwritten: std::collections::HashSet<(u32, u32)>,
    written: Vec<RemotePage>,
}

/// A store every node shares, holding sessions' pages, records and claims.
pub trait RemoteStore: Send + Sync {
    /// Takes the claim of `session` for `node`, if no other node holds a live one
    /// ([`RemoteError::Owned`] names the one that does). Cleans up what an earlier owner's
    /// interrupted write left (module docs).
    fn claim(&self, session: u64, node: &str) -> Result<Claim>;

    /// Extends the claim by the configured time, taking it back if it lapsed and no claim of
    /// the session was issued since; [`RemoteError::Fenced`] if it was lost (another node
    /// claimed the session since, or this one gave it up).
    fn renew(&self, claim: &mut Claim) -> Result<()>;

    /// Gives the claim up (nothing if it was lost already).
    fn give_up(&self, claim: &Claim) -> Result<()>;

    /// The node holding a live claim of `session`, if any.
    fn owner(&self, session: u64) -> Result<Option<String>>;

    /// Begins a write of `runs` ((layer, block) pairs) of the session `meta` describes (its
    /// `pages` are ignored: runs not named keep their stored pages): takes a generation and
    /// notes the runs as pending, so a writer that dies before [`RemoteStore::commit`] leaves
    /// nothing the next owner does not remove.
    fn begin(&self, claim: &Claim, meta: &SessionRecord, runs: &[(u32, u32)]) -> Result<Write>;

    /// Stores some of a begun write's runs (each once, in as many calls as the caller likes:
    /// a session too large for memory is written batch by batch).
    fn write(&self, w: &mut Write, runs: &[RemoteRun<'_>]) -> Result<()>;

    /// Commits a write whose every run is stored: the record names them from now on. Returns
    /// the write's generation; when it returns `Ok`, the runs and record are in the store (on
    /// `replicas` replicas of each master as well, where configured).
    fn commit(&self, w: Write) -> Result<u64>;

    /// [`RemoteStore::begin`], [`RemoteStore::write`] and [`RemoteStore::commit`] of runs
    /// held in memory.
    fn put_session(
        &self,
        claim: &Claim,
        meta: &SessionRecord,
        runs: &[RemoteRun<'_>],
    ) -> Result<u64> {
        let listed: Vec<(u32, u32)> = runs.iter().map(|r| (r.layer, r.block)).collect();
        let mut w = self.begin(claim, meta, &listed)?;
        self.write(&mut w, runs)?;
        self.commit(w)
    }

    /// The committed record of `session`, if the store holds it.
    fn record(&self, session: u64) -> Result<Option<RemoteRecord>>;

    /// The payloads of `wanted` (layer, block) runs of the session `record` describes, in
    /// order, each verified against the record. A run the record does not name, a missing
    /// page and a corrupt one are errors ([`RemoteError::is_data_loss`]).
    fn read_runs(&self, record: &RemoteRecord, wanted: &[(u32, u32)]) -> Result<Vec<Vec<u8>>>;

    /// The summaries of `wanted` (layer, block) runs, as [`RemoteStore::read_runs`] reads
    /// their payloads. A record written before summaries were stored has none
    /// ([`RemoteRecord::has_summaries`]): asking is [`RemoteError::NoSuchRun`].
    fn read_summaries(&self, record: &RemoteRecord, wanted: &[(u32, u32)]) -> Result<Vec<Vec<u8>>>;

    /// Removes the session's record and pages under the claim (the claim stays until
    /// given up).
    fn delete_session(&self, claim: &Claim) -> Result<()>;

    /// The ids of the sessions stored.
    fn session_ids(&self) -> Result<Vec<u64>>;
}
