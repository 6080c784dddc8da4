//! Speculative promotion: after a decode step on a session with cold (NVMe) blocks, a worker
//! thread re-ranks that layer with a wider budget and reads back the blocks ranked just below
//! the cut, so a next step whose keep-set shifts a little finds them in RAM.
//!
//! Best effort by design: jobs are dropped when the queue is full, a full host tier or a failed
//! read skips the job (the decode path reads and verifies on demand anyway), and the worker only
//! takes a session's lock after the step that queued it has released it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_channel::{bounded, Sender, TrySendError};

use kvtier_kernels::select::select_head;
use kvtier_kernels::SelectScratch;
use kvtier_storage::nvme::{NvmeTier, TierSource};
use kvtier_storage::{KvCache, Policy};

/// Runs a function on a session's KV cache under the session's lock.
pub type WithKv = Box<dyn FnOnce(&mut dyn FnMut(&mut KvCache) -> usize) -> usize + Send>;

/// Work for the prefetcher: one layer of one session, ranked by this query.
pub struct Job {
    pub session: u64,
    pub policy: Policy,
    pub layer: u32,
    pub q: Vec<f32>,
}

/// The queue and its worker thread (which ends when the queue is dropped).
pub struct Prefetcher {
    tx: Sender<(Job, WithKv)>,
    /// Blocks read ahead of need, for STATS.
    pub promoted: Arc<AtomicU64>,
}

/// Jobs waiting at most; more are dropped (the next step queues fresh ones).
const QUEUE: usize = 64;

impl Prefetcher {
    /// Starts the worker. `extra`: candidates per kv-head beyond the keep-set to bring in.
    pub fn start(tier: Arc<NvmeTier>, extra: u32) -> std::io::Result<Self> {
        let (tx, rx) = bounded::<(Job, WithKv)>(QUEUE);
        let promoted = Arc::new(AtomicU64::new(0));
        let count = promoted.clone();
        std::thread::Builder::new()
            .name("tierd-prefetch".into())
            .spawn(move || {
                let mut scratch = SelectScratch::default();
                for (job, with_kv) in rx {
                    let n = with_kv(&mut |kv| prefetch(kv, &tier, &job, extra, &mut scratch));
                    count.fetch_add(n as u64, Ordering::Relaxed);
                }
            })?;
        Ok(Prefetcher { tx, promoted })
    }

    /// Queues a job unless the queue is full; `with_kv` reaches the session's cache (the
    /// service's session handle, locked when called).
    pub fn offer(&self, job: Job, with_kv: WithKv) {
        if let Err(TrySendError::Full(_)) = self.tx.try_send((job, with_kv)) {
            tracing::debug!("prefetch queue full; job dropped");
        }
    }
}

/// Ranks `job.layer` with `top_k + extra` and promotes the cold blocks among the result.
fn prefetch(
    kv: &mut KvCache,
    tier: &NvmeTier,
    job: &Job,
    extra: u32,
    scratch: &mut SelectScratch,
) -> usize {
    let Ok(view) = kv.layer(job.layer) else {
        return 0;
    };
    let wide = Policy {
        top_k: job.policy.top_k.saturating_add(extra),
        ..job.policy
    };
    let mut wanted = Vec::new();
    let mut head = Vec::new();
    for h in 0..view.geometry().kv_heads as usize {
        select_head(&job.q, &view, view.blocks(), &wide, h, scratch, &mut head);
        wanted.extend_from_slice(&head);
    }
    wanted.sort_unstable();
    wanted.dedup();
    let src = TierSource {
        tier,
        session: job.session,
    };
    match kv.promote(job.layer, &wanted, &src) {
        Ok(n) => n,
        Err(e) => {
            tracing::debug!(session = job.session, error = %e, "prefetch skipped");
            0
        }
    }
}
