//! Appends by layer: RESERVE once, then per layer a DMA copy ([`InEngine::copy_layer`]) and a
//! COMMIT ([`InEngine::commit_layers`]) while the caller's model computes the later layers.
//!
//! The COMMITs and the committed layers' summaries run on the committer, two threads of its own
//! (one COMMITs, the other summarizes what was committed), which holds the engine's connection
//! from the first `commit_layers` to the last.
//! The caller's thread only enqueues copies and uploads the summaries the committer finished,
//! so the CPU work of a prefill's hand-off (tierd checking and summarizing the rows, the engine
//! summarizing them again for its device state) runs beside the forward instead of between its
//! layers, and the last `commit_layers` waits only for what is left.

use std::ops::Range;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kvtier_kernels::cuda::{CUstream, CudaError, CudaEvent};
use kvtier_protocol::client::Client;
use kvtier_protocol::{LeaseReply, ReserveReply, LAYER_COMMIT_VERSION};

use crate::append::{AppendTiming, DeviceRows};
use crate::arena::Mapped;
use crate::sync::{new_summaries, sync_layer, Part, Summaries};
use crate::{EngineError, InEngine, Result};

/// An append by layer in progress ([`InEngine::begin_append_by_layer`]).
#[derive(Debug)]
pub(crate) struct ByLayer {
    /// Each session's reservation, in the order the caller gave.
    reserved: Vec<(u64, ReserveReply)>,
    /// Where each layer stands.
    layers: Vec<LayerState>,
    timing: AppendTiming,
    /// Started by the first `commit_layers`.
    committer: Option<Committer>,
    /// Whether the device state of a committed layer was uploaded.
    uploaded: bool,
}

/// One layer of an append by layer: each goes through these once, in order.
#[derive(Debug)]
enum LayerState {
    Reserved,
    /// Copies enqueued ([`InEngine::copy_layer`]), behind this fence.
    Copied(CudaEvent),
    /// Handed to the committer.
    Committed,
}

/// The committer's two threads and the channels to them: the jobs go to the first, which
/// waits for the copies and COMMITs; the second summarizes what the first committed (while the
/// first COMMITs the next layers), and both send their results, or their first error, back.
#[derive(Debug)]
struct Committer {
    jobs: Sender<Job>,
    done: Receiver<Result<Done>>,
    /// Gives the connection back.
    commits: JoinHandle<Option<Client>>,
    summaries: JoinHandle<()>,
}

/// Layers to commit in every session of the append, once their copies are done.
struct Job {
    layers: Range<usize>,
    fences: Vec<CudaEvent>,
    /// Per session, in the append's order: its table of these layers once committed, and the
    /// blocks of each its device state holds whose summaries stay (see `new_summaries`).
    tables: Vec<(LeaseReply, Vec<usize>)>,
}

/// One session's layers committed in tierd, to summarize.
struct Committed {
    /// The session's place in the append.
    index: usize,
    layers: Range<usize>,
    table: LeaseReply,
    finals: Vec<usize>,
    timing: AppendTiming,
}

/// One session's layers committed, with their summaries computed.
struct Done {
    index: usize,
    layers: Range<usize>,
    table: LeaseReply,
    summaries: Vec<Summaries>,
    timing: AppendTiming,
}

/// The COMMITs: the first thread's work besides its jobs.
struct Commits {
    client: Client,
    /// `(session, rows)` in the append's order.
    sessions: Vec<(u64, u32)>,
}

impl Commits {
    /// COMMITs each job's layers in order, handing each session's to the summaries; after the
    /// first error it only drains the jobs (the caller drops the append). Gives the connection
    /// back at the end.
    fn run(
        mut self,
        jobs: Receiver<Job>,
        committed: Sender<Committed>,
        done: Sender<Result<Done>>,
    ) -> Client {
        let mut failed = false;
        for job in jobs {
            if failed {
                continue;
            }
            if let Err(e) = self.commit(job, &committed) {
                failed = true;
                let _ = done.send(Err(e));
            }
        }
        self.client
    }

    fn commit(&mut self, job: Job, committed: &Sender<Committed>) -> Result<()> {
        let t = Instant::now();
        for fence in &job.fences {
            fence.synchronize().map_err(|e| CudaError::Driver {
                call: "cuEventSynchronize",
                source: e,
            })?;
        }
        let mut copy = t.elapsed();
        let (first, count) = (job.layers.start, job.layers.len());
        for (index, (&(session, rows), (table, finals))) in
            self.sessions.iter().zip(job.tables).enumerate()
        {
            let t = Instant::now();
            self.client
                .commit_layers(session, rows, first as u32, count as u32)?;
            let timing = AppendTiming {
                copy: std::mem::take(&mut copy),
                commit: t.elapsed(),
                ..AppendTiming::default()
            };
            let piece = Committed {
                index,
                layers: job.layers.clone(),
                table,
                finals,
                timing,
            };
            if committed.send(piece).is_err() {
                // The summaries ended on an error (reported): commit no more.
                return Err(EngineError::InPlace("the summaries stopped".into()));
            }
        }
        Ok(())
    }
}

/// The summaries: the second thread's work.
struct Summarize {
    mapped: Arc<Mapped>,
    part: Part,
    sketches: bool,
}

impl Summarize {
    /// Summarizes each committed piece for the device state, until the COMMITs end or the
    /// first error.
    fn run(self, committed: Receiver<Committed>, done: Sender<Result<Done>>) {
        for c in committed {
            let t = Instant::now();
            let summaries = new_summaries(
                &self.mapped.view,
                &c.table,
                &self.part,
                self.sketches,
                c.layers.start,
                &c.finals,
            );
            let piece = summaries.map(|summaries| Done {
                index: c.index,
                layers: c.layers,
                table: c.table,
                summaries,
                timing: AppendTiming {
                    sync: t.elapsed(),
                    ..c.timing
                },
            });
            let failed = piece.is_err();
            if done.send(piece).is_err() || failed {
                return;
            }
        }
    }
}

impl InEngine {
    /// Opens an append of `tokens` rows to each `(session, tokens)` that the caller copies
    /// layer by layer ([`InEngine::copy_layer`]) and commits layer by layer
    /// ([`InEngine::commit_layers`]) while its model still computes the later layers: RESERVE
    /// for each. Needs [`InEngine::enable_in_place_appends`] and tierd's protocol version 5.
    pub fn begin_append_by_layer(&mut self, items: &[(u64, u32)]) -> Result<()> {
        self.check_in_place()?;
        if self.by_layer.is_some() {
            return Err(EngineError::InPlace(
                "an append by layer is already open".into(),
            ));
        }
        let version = self.client()?.server().version;
        if version < LAYER_COMMIT_VERSION {
            return Err(EngineError::InPlace(format!(
                "tierd speaks protocol version {version}; committing layer by layer needs {LAYER_COMMIT_VERSION}"
            )));
        }
        for &(session, tokens) in items {
            self.slot_of(session)?;
            if tokens == 0 {
                return Err(EngineError::InPlace(format!(
                    "session {session}: an append of 0 rows"
                )));
            }
        }
        let t = Instant::now();
        let reserved = self.reserve_each(items)?;
        let reserved = items.iter().map(|&(s, _)| s).zip(reserved).collect();
        let layers = self.full.layers as usize;
        self.by_layer = Some(ByLayer {
            reserved,
            layers: (0..layers).map(|_| LayerState::Reserved).collect(),
            timing: AppendTiming {
                reserve: t.elapsed(),
                ..AppendTiming::default()
            },
            committer: None,
            uploaded: false,
        });
        Ok(())
    }

    /// Enqueues on `stream` the copies of layer `layer`'s rows of each session of the open
    /// append by layer (`rows.ptr`: that layer's rows, `tokens` of them as reserved), behind
    /// the work that produces them, and returns at once. On error the append is dropped.
    ///
    /// # Safety
    /// Each item's rows are device memory of the engine's device (primary context) that stays
    /// allocated and unchanged until the copies have run: work enqueued on `stream` after this
    /// call runs after them, and the last [`InEngine::commit_layers`] returns after them;
    /// `stream` is a live stream of that context.
    pub unsafe fn copy_layer(
        &mut self,
        layer: usize,
        items: &[(u64, DeviceRows)],
        stream: CUstream,
    ) -> Result<()> {
        let t = Instant::now();
        // SAFETY: the caller's contract, passed on.
        let done = unsafe { self.try_copy_layer(layer, items, stream) };
        if let Err(e) = done {
            self.drop_append_by_layer();
            return Err(e);
        }
        if let Some(a) = &mut self.by_layer {
            a.timing.copy += t.elapsed();
        }
        Ok(())
    }

    /// [`InEngine::copy_layer`] without the clean-up.
    ///
    /// # Safety
    /// As [`InEngine::copy_layer`].
    unsafe fn try_copy_layer(
        &mut self,
        layer: usize,
        items: &[(u64, DeviceRows)],
        stream: CUstream,
    ) -> Result<()> {
        let a = self
            .by_layer
            .as_ref()
            .ok_or_else(|| not_open("copy_layer"))?;
        if !matches!(a.layers.get(layer), Some(LayerState::Reserved)) {
            return Err(EngineError::InPlace(format!(
                "layer {layer}: out of range, or copied already"
            )));
        }
        if items.len() != a.reserved.len()
            || items
                .iter()
                .zip(&a.reserved)
                .any(|(&(s, rows), (rs, r))| s != *rs || rows.capacity < r.tokens)
        {
            return Err(EngineError::InPlace(
                "copy_layer: not the append's sessions in its order, or fewer slots than rows"
                    .into(),
            ));
        }
        for (&(_, rows), (_, r)) in items.iter().zip(&a.reserved) {
            // SAFETY: the caller's contract on the rows and the stream, passed on.
            unsafe { self.enqueue_rows(rows, r, layer..layer + 1, stream) }?;
        }
        let region = &self.mapped.as_ref().expect("leased, so mapped").region;
        // SAFETY: the caller's contract: `stream` is a live stream of the context.
        let fence = unsafe { region.fence(stream) }?;
        self.by_layer.as_mut().expect("open").layers[layer] = LayerState::Copied(fence);
        Ok(())
    }

    /// Hands layers `layers` (each copied, none committed) to the committer, which waits for
    /// their copies, COMMITs them in each session (tierd checks and summarizes their rows; the
    /// COMMIT of the last layers lands the append) and summarizes them for the engine's device
    /// state; uploads what it finished so far, and returns. The call that commits the last
    /// layers waits for the rest. An error (here, or the committer's on an earlier call's
    /// layers) drops the append, in tierd and on the device.
    pub fn commit_layers(&mut self, layers: Range<usize>) -> Result<()> {
        let done = self.try_commit_layers(layers);
        if done.is_err() {
            self.drop_append_by_layer();
        }
        done
    }

    /// [`InEngine::commit_layers`] without the clean-up.
    fn try_commit_layers(&mut self, layers: Range<usize>) -> Result<()> {
        let a = self
            .by_layer
            .as_mut()
            .ok_or_else(|| not_open("commit_layers"))?;
        if layers.is_empty()
            || layers.end > a.layers.len()
            || !a.layers[layers.clone()]
                .iter()
                .all(|l| matches!(l, LayerState::Copied(_)))
        {
            return Err(EngineError::InPlace(format!(
                "layers {layers:?}: empty, out of range, not copied or committed already"
            )));
        }
        let fences = a.layers[layers.clone()]
            .iter_mut()
            .map(|l| match std::mem::replace(l, LayerState::Committed) {
                LayerState::Copied(fence) => fence,
                _ => unreachable!("checked"),
            })
            .collect();
        let last = a.layers.iter().all(|l| matches!(l, LayerState::Committed));
        let reserved = &self.by_layer.as_ref().expect("open").reserved;
        let tables = self.tables_after(reserved, layers.clone())?;
        if self.by_layer.as_ref().expect("open").committer.is_none() {
            let committer = self.start_committer()?;
            self.by_layer.as_mut().expect("open").committer = Some(committer);
        }
        let a = self.by_layer.as_mut().expect("open");
        let c = a.committer.as_ref().expect("started");
        let job = Job {
            layers,
            fences,
            tables,
        };
        if c.jobs.send(job).is_err() {
            return Err(EngineError::InPlace("the committer is gone".into()));
        }
        if !last {
            // Upload what is done, without waiting for the rest.
            loop {
                let a = self.by_layer.as_mut().expect("open");
                let c = a.committer.as_ref().expect("started");
                match c.done.try_recv() {
                    Ok(piece) => self.upload(piece?)?,
                    Err(_) => return Ok(()),
                }
            }
        }
        // The last layers: close the job queue, upload the rest as it comes, take the
        // connection back.
        let c = self
            .by_layer
            .as_mut()
            .expect("open")
            .committer
            .take()
            .expect("started");
        drop(c.jobs);
        let mut first_error = None;
        for piece in c.done.iter() {
            match piece.and_then(|p| self.upload(p)) {
                Ok(()) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let _ = c.summaries.join();
        self.client = Some(c.commits.join().ok().flatten().ok_or_else(|| {
            EngineError::InPlace("the committer's thread panicked; the connection is lost".into())
        })?);
        if let Some(e) = first_error {
            return Err(e);
        }
        let a = self.by_layer.take().expect("open");
        self.last_append = Some(a.timing);
        Ok(())
    }

    /// Per session of `reserved`, its table of `layers` once they are committed, and the final
    /// blocks its device state holds of each.
    fn tables_after(
        &self,
        reserved: &[(u64, ReserveReply)],
        layers: Range<usize>,
    ) -> Result<Vec<(LeaseReply, Vec<usize>)>> {
        let mut tables = Vec::with_capacity(reserved.len());
        for (session, r) in reserved {
            let table = self
                .reserved_table(*session, r, layers.clone())
                .ok_or_else(|| {
                    EngineError::InPlace(format!(
                        "session {session}: its device state does not end where its reservation starts"
                    ))
                })?;
            let s = self.sessions.get(session).expect("attached");
            let finals = s.layers[layers.clone()]
                .iter()
                .map(|l| l.final_blocks())
                .collect();
            tables.push((table, finals));
        }
        Ok(tables)
    }

    /// Moves the connection to a new committer (its two threads) for the open append.
    fn start_committer(&mut self) -> Result<Committer> {
        let a = self.by_layer.as_ref().expect("open");
        let sessions = a.reserved.iter().map(|(s, r)| (*s, r.tokens)).collect();
        let summarize = Summarize {
            mapped: self.mapped.clone().expect("leased, so mapped"),
            part: self.part(),
            sketches: self.be.config().sketch(),
        };
        self.client()?; // the engine's, not an earlier append's
        let spawn_error =
            |e: std::io::Error| EngineError::InPlace(format!("starting the committer: {e}"));
        let (jobs, jobs_rx) = mpsc::channel();
        let (committed, committed_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let done_summaries = done_tx.clone();
        let summaries = std::thread::Builder::new()
            .name("kvtier-summarize".into())
            .spawn(move || summarize.run(committed_rx, done_summaries))
            .map_err(spawn_error)?;
        // The COMMIT thread starts before it takes the connection, from a channel: if the OS
        // refuses the thread, the connection stays with the engine.
        let (work, work_rx) = mpsc::channel::<Commits>();
        let commits = std::thread::Builder::new()
            .name("kvtier-commit".into())
            .spawn(move || Some(work_rx.recv().ok()?.run(jobs_rx, committed, done_tx)))
            .map_err(spawn_error)?;
        let client = self.client.take().expect("checked");
        if let Err(mpsc::SendError(w)) = work.send(Commits { client, sessions }) {
            self.client = Some(w.client);
            return Err(EngineError::InPlace(
                "the committer ended at its start".into(),
            ));
        }
        Ok(Committer {
            jobs,
            done,
            commits,
            summaries,
        })
    }

    /// Brings the device state of one session's committed layers up to date.
    fn upload(&mut self, piece: Done) -> Result<()> {
        let t = Instant::now();
        let part = self.part();
        let a = self.by_layer.as_mut().expect("open");
        a.uploaded = true; // before the first upload, which may fail part way
        let session = a.reserved[piece.index].0;
        let s = self.sessions.get_mut(&session).expect("attached");
        for (l, sums) in piece.layers.clone().zip(&piece.summaries) {
            let (ls, want) = (&mut s.layers[l], &piece.table.layers[l]);
            sync_layer(&mut self.be, &part, s.slot, l, ls, want, sums)?;
        }
        let timing = &mut self.by_layer.as_mut().expect("open").timing;
        timing.copy += piece.timing.copy;
        timing.commit += piece.timing.commit;
        timing.sync += piece.timing.sync + t.elapsed();
        Ok(())
    }

    /// Drops the open append by layer: its committer stopped and the connection taken back,
    /// then in tierd (COMMIT 0 ends a reservation still open) and on the device, whose state
    /// of layers already committed is brought back to tierd's.
    pub(crate) fn drop_append_by_layer(&mut self) {
        let Some(a) = self.by_layer.take() else {
            return;
        };
        if let Some(c) = a.committer {
            self.client = c.stop();
        }
        self.drop_reservations(a.reserved.iter().map(|&(s, _)| s));
        for (session, _) in &a.reserved {
            // Layers uploaded before the error hold rows tierd dropped with the append (a
            // failed COMMIT ends it whole), and a device state never shrinks: start over.
            let _ = match a.uploaded {
                true => self.resync(*session),
                false => self.sync(*session),
            };
        }
    }
}

impl Committer {
    /// Stops after the jobs already sent, discarding their results; the connection back
    /// (None if the COMMIT thread panicked).
    fn stop(self) -> Option<Client> {
        drop(self.jobs);
        for _ in self.done.iter() {}
        let _ = self.summaries.join();
        self.commits.join().ok().flatten()
    }
}

impl Drop for InEngine {
    /// An append by layer still open is dropped with the engine: its committer stops and the
    /// connection closes now, with the engine (tierd then drops the reservation), not whenever
    /// the committer's thread ends.
    fn drop(&mut self) {
        if let Some(c) = self.by_layer.as_mut().and_then(|a| a.committer.take()) {
            self.client = c.stop();
        }
    }
}

fn not_open(call: &str) -> EngineError {
    EngineError::InPlace(format!(
        "{call}: no append by layer is open (begin_append_by_layer)"
    ))
}
