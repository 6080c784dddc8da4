//! Coalescing concurrent requests into one device call (flat combining).
//!
//! Requests for one device arrive on many connections, each on its own blocking-pool thread. A
//! device call costs about the same for one entry as for eight (launches, synchronisations and
//! small copies dominate a hot step), so running them one by one under the device lock wastes
//! the device. Here the first thread to arrive becomes the leader: it takes every queued request
//! (whatever its layer: the device runs a call's layers back to back), runs them as one call and
//! hands each its answer; then it passes the lead to the oldest request still queued (which
//! arrived while the call ran), so no thread serves others for more than one call. Followers
//! only wait.
//!
//! Taking only the leader's own layer (as first built) left 8 concurrent sessions, which drift
//! apart in their layers, with about 3 requests per call on the GPU host (docs/benchmarks.md).

use std::sync::mpsc::{sync_channel, SyncSender};

use parking_lot::Mutex;

/// What a waiting request receives.
enum Msg<R> {
    Done(R),
    /// Lead: run the queue (the request itself is still queued).
    Lead,
}

struct Queued<J, R> {
    job: J,
    id: u64,
    tx: SyncSender<Msg<R>>,
}

struct State<J, R> {
    leading: bool,
    next_id: u64,
    queue: Vec<Queued<J, R>>,
}

pub(super) struct Coalescer<J, R> {
    state: Mutex<State<J, R>>,
}

impl<J, R> Default for Coalescer<J, R> {
    fn default() -> Self {
        Coalescer {
            state: Mutex::new(State {
                leading: false,
                next_id: 0,
                queue: Vec::new(),
            }),
        }
    }
}

impl<J, R> Coalescer<J, R> {
    /// Submits `job` and returns its answer. `run` answers a batch of jobs, one result per job
    /// in order; it is called by whichever thread leads, never by two threads at once. `lost`
    /// answers a job whose batch panicked (a bug; the panic is caught so that the queue keeps
    /// moving and no waiter hangs).
    pub(super) fn submit(&self, job: J, run: &dyn Fn(Vec<J>) -> Vec<R>, lost: &dyn Fn() -> R) -> R {
        let (tx, rx) = sync_channel(1);
        let (id, lead) = {
            let mut st = self.state.lock();
            let id = st.next_id;
            st.next_id += 1;
            st.queue.push(Queued { job, id, tx });
            let lead = !st.leading;
            st.leading = true;
            (id, lead)
        };
        if !lead {
            match rx.recv() {
                Ok(Msg::Done(r)) => return r,
                Ok(Msg::Lead) => {}
                // Only a leader holds the sender, and it always sends before letting go.
                Err(_) => return lost(),
            }
        }
        self.lead(id, run, lost);
        match rx.try_recv() {
            Ok(Msg::Done(r)) => r,
            _ => lost(),
        }
    }

    /// Runs the batch of every queued request (`me` among them), then passes the lead to the
    /// oldest request queued meanwhile (or drops it when nothing is queued).
    fn lead(&self, me: u64, run: &dyn Fn(Vec<J>) -> Vec<R>, lost: &dyn Fn() -> R) {
        let batch: Vec<Queued<J, R>> = {
            let mut st = self.state.lock();
            debug_assert!(
                st.queue.iter().any(|q| q.id == me),
                "the leader's request is queued until answered"
            );
            std::mem::take(&mut st.queue)
        };
        let (txs, jobs): (Vec<_>, Vec<_>) = batch.into_iter().map(|q| (q.tx, q.job)).unzip();
        let n = txs.len();
        let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(jobs)))
            .ok()
            .filter(|r| r.len() == n)
            .unwrap_or_else(|| (0..n).map(|_| lost()).collect());
        for (tx, r) in txs.into_iter().zip(results) {
            // Every waiter blocks until answered, so the send cannot fail.
            let _ = tx.send(Msg::Done(r));
        }
        let mut st = self.state.lock();
        match st.queue.first() {
            Some(next) => {
                let _ = next.tx.send(Msg::Lead);
            }
            None => st.leading = false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    use super::*;

    /// Many threads: every job gets its own answer, batches never overlap, and jobs that
    /// arrive while a batch runs (whatever their layer) join the next one.
    #[test]
    fn every_job_is_answered_once_by_one_batch_at_a_time() {
        let c: Arc<Coalescer<(u32, usize), (u32, usize)>> = Arc::default();
        let running = Arc::new(AtomicBool::new(false));
        let batches = Arc::new(Mutex::new(Vec::<Vec<(u32, usize)>>::new()));
        let threads = 16;
        let start = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (c, running, batches, start) =
                    (c.clone(), running.clone(), batches.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    for i in 0..20 {
                        let key = (t % 2) as u32;
                        let job = (key, t * 1000 + i);
                        let run = |jobs: Vec<(u32, usize)>| {
                            assert!(!running.swap(true, Ordering::SeqCst), "two batches at once");
                            batches.lock().push(jobs.clone());
                            std::thread::sleep(Duration::from_micros(300));
                            running.store(false, Ordering::SeqCst);
                            jobs
                        };
                        let r = c.submit(job, &run, &|| panic!("no batch panics here"));
                        assert_eq!(r, job, "its own answer");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let batches = batches.lock();
        let jobs: usize = batches.iter().map(Vec::len).sum();
        assert_eq!(jobs, threads * 20, "every job ran exactly once");
        assert!(
            batches.iter().any(|b| b.len() > 1),
            "jobs queued behind a running batch are coalesced ({} batches)",
            batches.len()
        );
        assert!(
            batches.iter().any(|b| b.iter().any(|j| j.0 != b[0].0)),
            "jobs of different layers share a batch"
        );
        assert!(
            !c.state.lock().leading,
            "the lead is dropped when the queue is empty"
        );
    }

    /// A batch that panics answers its jobs with `lost` and the queue goes on.
    #[test]
    fn a_panicking_batch_answers_lost_and_the_next_one_runs() {
        let c: Coalescer<u32, Result<u32, &str>> = Coalescer::default();
        let calls = AtomicUsize::new(0);
        let run = |jobs: Vec<u32>| {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("injected");
            }
            jobs.into_iter().map(Ok).collect()
        };
        // (The caught panic prints its message; the test passes.)
        assert_eq!(c.submit(7, &run, &|| Err("lost")), Err("lost"));
        assert_eq!(c.submit(8, &run, &|| Err("lost")), Ok(8));
        assert!(!c.state.lock().leading);
    }
}
