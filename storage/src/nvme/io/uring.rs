//! io_uring driver: one dedicated thread owns the ring; callers send batches over a channel
//! and block on a per-batch reply channel. Completions are matched by `user_data` (a slot in
//! the in-flight table).
//!
//! Correctness rules this file enforces:
//! - every completion's byte count is checked; a short transfer resubmits the remainder, and
//!   a read that hits end of file (0 bytes) or a write that stops progressing is an error;
//! - -EINTR / -EAGAIN completions are resubmitted (bounded);
//! - at most `queue_depth` operations are in the kernel; the CQ has 2x that many entries, the
//!   kernel must have IORING_FEAT_NODROP (so an overflow delays completions, never loses
//!   them) and the overflow counter is checked on every reap;
//! - a full SQ is flushed with a submit before pushing more;
//! - a buffer whose operation may still be in the kernel is never freed (leaked if the
//!   thread has to give up), because the kernel would write into freed memory.
//!
//! While operations are in flight the thread sleeps in `io_uring_enter`; a read of an eventfd
//! is kept armed in the ring and callers write the eventfd after queueing a batch, so a new
//! batch is submitted at once instead of waiting for some earlier operation to complete.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::pread::errno_error;
use super::{IoCompletion, IoDriver, IoRequest, OpKind};
use crate::nvme::NvmeError;

/// io_uring driver settings.
#[derive(Debug, Clone, Copy)]
pub struct UringConfig {
    /// Maximum operations in the kernel at once (SQ size; the CQ gets twice this).
    pub queue_depth: u32,
}

impl Default for UringConfig {
    fn default() -> Self {
        Self { queue_depth: 128 }
    }
}

/// Counters of the ring thread (relaxed atomics, read by `stats()`).
#[derive(Debug, Default)]
struct Counters {
    ops: AtomicU64,
    resubmits_short: AtomicU64,
    retries_eintr_eagain: AtomicU64,
    cq_overflow: AtomicU64,
    sq_full: AtomicU64,
}

/// A snapshot of the driver's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UringStats {
    /// Operations completed (successfully or not).
    pub ops: u64,
    /// Remainders resubmitted after a short read or write.
    pub resubmits_short: u64,
    /// Operations resubmitted after -EINTR or -EAGAIN.
    pub retries_eintr_eagain: u64,
    /// The kernel's CQ overflow counter (non-zero means completions were delayed).
    pub cq_overflow: u64,
    /// Times the SQ was full and had to be flushed before pushing.
    pub sq_full: u64,
}

struct Batch {
    reqs: Vec<IoRequest>,
    reply: Sender<Vec<IoCompletion>>,
}

/// The io_uring driver. Dropping it waits for every in-flight operation to finish.
pub struct UringDriver {
    tx: Option<Sender<Batch>>,
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    depth: u32,
}

impl std::fmt::Debug for UringDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringDriver")
            .field("depth", &self.depth)
            .finish()
    }
}

fn unavailable(reason: &str, e: io::Error) -> NvmeError {
    NvmeError::UringUnavailable {
        reason: format!("{reason}: {e}"),
        source: Some(e),
    }
}

impl UringDriver {
    /// Sets up a ring and its thread, and proves the ring works with a NOP round trip (some
    /// sandboxes allow io_uring_setup but block io_uring_enter). Errors are
    /// [`NvmeError::UringUnavailable`]: fall back to [`super::PreadDriver`].
    pub fn new(cfg: UringConfig) -> Result<Self, NvmeError> {
        let depth = cfg.queue_depth;
        if depth == 0 || depth > 4096 || !depth.is_power_of_two() {
            return Err(NvmeError::invalid(format!(
                "io_uring queue depth {depth} must be a power of two in 1..=4096"
            )));
        }
        let mut ring: IoUring<squeue::Entry, cqueue::Entry> = IoUring::builder()
            .setup_cqsize(depth * 2)
            .build(depth)
            .map_err(|e| unavailable("io_uring_setup", e))?;
        if !ring.params().is_feature_nodrop() {
            return Err(NvmeError::UringUnavailable {
                reason: "kernel lacks IORING_FEAT_NODROP (CQ overflow could lose completions)"
                    .into(),
                source: None,
            });
        }
        // Round trip a NOP before trusting the ring.
        let nop = opcode::Nop::new().build().user_data(u64::MAX);
        // SAFETY: a NOP references no memory.
        unsafe { ring.submission().push(&nop) }.map_err(|_| NvmeError::UringUnavailable {
            reason: "fresh SQ is full".into(),
            source: None,
        })?;
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(unavailable("io_uring_enter", e)),
            }
        }
        let nop_res = ring.completion().next().map(|c| c.result());
        if nop_res != Some(0) {
            return Err(NvmeError::UringUnavailable {
                reason: format!("NOP completed with {nop_res:?}"),
                source: None,
            });
        }

        let wake = Arc::new(EventFd::new().map_err(|e| unavailable("eventfd", e))?);
        let (tx, rx) = crossbeam_channel::unbounded::<Batch>();
        let counters = Arc::new(Counters::default());
        let c2 = counters.clone();
        let w2 = wake.clone();
        let thread = std::thread::Builder::new()
            .name("kvtier-uring".into())
            .spawn(move || RingThread::new(ring, depth as usize, rx, c2, w2).run())
            .map_err(|e| unavailable("spawn ring thread", e))?;
        Ok(Self {
            tx: Some(tx),
            wake,
            thread: Some(thread),
            counters,
            depth,
        })
    }

    pub fn queue_depth(&self) -> u32 {
        self.depth
    }

    pub fn stats(&self) -> UringStats {
        let c = &self.counters;
        UringStats {
            ops: c.ops.load(Ordering::Relaxed),
            resubmits_short: c.resubmits_short.load(Ordering::Relaxed),
            retries_eintr_eagain: c.retries_eintr_eagain.load(Ordering::Relaxed),
            cq_overflow: c.cq_overflow.load(Ordering::Relaxed),
            sq_full: c.sq_full.load(Ordering::Relaxed),
        }
    }
}

impl IoDriver for UringDriver {
    fn submit(&self, reqs: Vec<IoRequest>) -> Result<Vec<IoCompletion>, NvmeError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, done) = crossbeam_channel::bounded(1);
        let tx = self.tx.as_ref().ok_or(NvmeError::DriverStopped)?;
        tx.send(Batch { reqs, reply })
            .map_err(|_| NvmeError::DriverStopped)?;
        self.wake.notify();
        done.recv().map_err(|_| NvmeError::DriverStopped)
    }

    fn name(&self) -> &'static str {
        "io_uring"
    }
}

impl Drop for UringDriver {
    fn drop(&mut self) {
        // Closing the channel tells the thread to finish in-flight work and exit.
        drop(self.tx.take());
        self.wake.notify();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("io_uring thread panicked");
            }
        }
    }
}

/// An eventfd used to wake the ring thread.
#[derive(Debug)]
struct EventFd(OwnedFd);

impl EventFd {
    fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; a non-negative return is a new fd we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by eventfd and is owned by nobody else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. Failure (only EAGAIN
        // at counter overflow, when a wake-up is pending anyway) is harmless.
        let _ = unsafe {
            libc::write(
                self.0.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// The 8-byte target of the armed eventfd read. Leaked rather than freed if the thread ends
/// while the read may still be in the kernel.
struct WakeBuf {
    buf: Option<Box<u64>>,
    armed: bool,
}

impl Drop for WakeBuf {
    fn drop(&mut self) {
        if self.armed {
            std::mem::forget(self.buf.take());
        }
    }
}

const WAKE: u64 = u64::MAX;

/// Resubmission limits: generous, but a stuck operation must end as an error.
const MAX_RETRIES: u32 = 1000;
const MAX_STALLS: u32 = 8;

struct Op {
    req: IoRequest,
    done: usize,
    batch: usize,
    index: usize,
    retries: u32,
    stalls: u32,
}

struct BatchState {
    results: Vec<Option<IoCompletion>>,
    remaining: usize,
    reply: Sender<Vec<IoCompletion>>,
}

/// In-flight operations by slot (= user_data). If it is dropped while operations may still
/// be in the kernel (thread unwinding or giving up), their buffers are leaked, not freed.
struct Slots {
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    live: usize,
}

impl Slots {
    fn insert(&mut self, op: Op) -> usize {
        self.live += 1;
        if let Some(i) = self.free.pop() {
            self.slots[i] = Some(op);
            i
        } else {
            self.slots.push(Some(op));
            self.slots.len() - 1
        }
    }

    fn take(&mut self, i: usize) -> Option<Op> {
        let op = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        self.live -= 1;
        Some(op)
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if self.live > 0 {
            tracing::error!(
                live = self.live,
                "io_uring thread exiting with operations in flight; leaking their buffers"
            );
            for op in self.slots.drain(..).flatten() {
                std::mem::forget(op);
            }
        }
    }
}

struct RingThread {
    ring: IoUring<squeue::Entry, cqueue::Entry>,
    depth: usize,
    rx: Receiver<Batch>,
    counters: Arc<Counters>,
    pending: VecDeque<Op>,
    batches: Vec<Option<BatchState>>,
    free_batches: Vec<usize>,
    slots: Slots,
    last_overflow: u32,
    closed: bool,
    wake: Arc<EventFd>,
    wake_buf: WakeBuf,
}

impl RingThread {
    fn new(
        ring: IoUring<squeue::Entry, cqueue::Entry>,
        depth: usize,
        rx: Receiver<Batch>,
        counters: Arc<Counters>,
        wake: Arc<EventFd>,
    ) -> Self {
        Self {
            ring,
            depth,
            rx,
            counters,
            pending: VecDeque::new(),
            batches: Vec::new(),
            free_batches: Vec::new(),
            slots: Slots {
                slots: Vec::new(),
                free: Vec::new(),
                live: 0,
            },
            last_overflow: 0,
            closed: false,
            wake,
            wake_buf: WakeBuf {
                buf: Some(Box::new(0)),
                armed: false,
            },
        }
    }

    fn run(mut self) {
        loop {
            if self.slots.live == 0 && self.pending.is_empty() {
                if self.closed {
                    self.disarm_wake();
                    return;
                }
                match self.rx.recv() {
                    Ok(b) => self.accept(b),
                    Err(_) => return,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(b) => self.accept(b),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.closed = true;
                        break;
                    }
                }
            }
            if let Err(e) = self.fill_and_submit() {
                // The ring itself failed: nothing more can be trusted. Operations the
                // kernel may hold keep their buffers (leaked by Slots::drop); callers see
                // DriverStopped because their reply senders are dropped.
                tracing::error!(error = %e, "io_uring submit failed fatally; driver stopping");
                return;
            }
            self.reap();
        }
    }

    fn accept(&mut self, b: Batch) {
        let n = b.reqs.len();
        let state = BatchState {
            results: (0..n).map(|_| None).collect(),
            remaining: n,
            reply: b.reply,
        };
        let id = if let Some(i) = self.free_batches.pop() {
            self.batches[i] = Some(state);
            i
        } else {
            self.batches.push(Some(state));
            self.batches.len() - 1
        };
        for (index, req) in b.reqs.into_iter().enumerate() {
            self.pending.push_back(Op {
                req,
                done: 0,
                batch: id,
                index,
                retries: 0,
                stalls: 0,
            });
        }
    }

    fn sqe_for(op: &mut Op, user_data: u64) -> squeue::Entry {
        let fd = types::Fd(op.req.file().raw_fd());
        let off = op.req.offset() + op.done as u64;
        let rest = (op.req.len() - op.done) as u32;
        match op.req.kind() {
            OpKind::Read => {
                // SAFETY: done < len, so the pointer stays inside the buffer.
                let ptr = unsafe { op.req.buf_mut().as_mut_ptr().add(op.done) };
                opcode::Read::new(fd, ptr, rest)
                    .offset(off)
                    .build()
                    .user_data(user_data)
            }
            OpKind::Write => {
                // SAFETY: done < len, so the pointer stays inside the buffer.
                let ptr = unsafe { op.req.buf().as_ptr().add(op.done) };
                opcode::Write::new(fd, ptr, rest)
                    .offset(off)
                    .build()
                    .user_data(user_data)
            }
        }
    }

    fn fill_and_submit(&mut self) -> io::Result<()> {
        while self.slots.live < self.depth {
            let Some(op) = self.pending.pop_front() else {
                break;
            };
            let slot = self.slots.insert(op);
            let op = self.slots.slots[slot].as_mut().expect("just inserted");
            op.req.mark_started();
            let sqe = Self::sqe_for(op, slot as u64);
            loop {
                // SAFETY: the buffer and the file the SQE points at are owned by the Op in
                // `slots`, which is not removed (nor its buffer freed) before the kernel's
                // completion for this user_data is reaped; the file's Arc keeps the fd open.
                let pushed = unsafe { self.ring.submission().push(&sqe) };
                if pushed.is_ok() {
                    break;
                }
                self.counters.sq_full.fetch_add(1, Ordering::Relaxed);
                self.submit_retrying(0)?;
            }
        }
        if self.slots.live > 0 {
            self.arm_wake()?;
            self.submit_retrying(1)?;
        }
        Ok(())
    }

    /// Keeps a read of the wake eventfd in the ring, so a caller's notify ends our wait.
    fn arm_wake(&mut self) -> io::Result<()> {
        if self.wake_buf.armed || self.closed {
            return Ok(());
        }
        let ptr: *mut u64 = &mut **self.wake_buf.buf.as_mut().expect("present");
        let sqe = opcode::Read::new(types::Fd(self.wake.0.as_raw_fd()), ptr.cast(), 8)
            .build()
            .user_data(WAKE);
        loop {
            // SAFETY: the 8-byte target is a heap box owned by `wake_buf`, never freed while
            // `armed` is set (WakeBuf::drop leaks it); the eventfd is kept open by `wake`.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                self.wake_buf.armed = true;
                return Ok(());
            }
            self.counters.sq_full.fetch_add(1, Ordering::Relaxed);
            self.submit_retrying(0)?;
        }
    }

    /// Completes an armed wake read before exiting, so its buffer can be freed.
    fn disarm_wake(&mut self) {
        for _ in 0..1000 {
            if !self.wake_buf.armed {
                return;
            }
            self.wake.notify();
            if self.ring.submit_and_wait(1).is_err() {
                continue;
            }
            self.reap();
        }
    }

    fn submit_retrying(&mut self, want: usize) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // EBUSY: the kernel holds overflowed CQEs; reap them, then go on.
                    Some(libc::EBUSY) | Some(libc::EAGAIN) => {
                        self.reap();
                        if want > 0 {
                            return Ok(());
                        }
                    }
                    _ => return Err(e),
                },
            }
        }
    }

    fn reap(&mut self) {
        let mut cq = self.ring.completion();
        cq.sync();
        let overflow = cq.overflow();
        if overflow != self.last_overflow {
            tracing::warn!(overflow, "io_uring CQ overflowed; completions were delayed");
            self.counters
                .cq_overflow
                .store(u64::from(overflow), Ordering::Relaxed);
            self.last_overflow = overflow;
        }
        let done: Vec<(u64, i32)> = cq.map(|c| (c.user_data(), c.result())).collect();
        for (ud, res) in done {
            if ud == WAKE {
                self.wake_buf.armed = false;
                continue;
            }
            let Some(op) = self.slots.take(ud as usize) else {
                tracing::error!(user_data = ud, "completion for unknown io_uring slot");
                continue;
            };
            self.on_completion(op, res);
        }
    }

    fn on_completion(&mut self, mut op: Op, res: i32) {
        let kind = op.req.kind();
        let len = op.req.len();
        let offset = op.req.offset();
        if res < 0 {
            let errno = -res;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && op.retries < MAX_RETRIES {
                op.retries += 1;
                self.counters
                    .retries_eintr_eagain
                    .fetch_add(1, Ordering::Relaxed);
                self.pending.push_front(op);
                return;
            }
            let err = errno_error(kind, offset, len, io::Error::from_raw_os_error(errno));
            return self.finish(op, Err(err));
        }
        let n = res as usize;
        if n == 0 {
            match kind {
                OpKind::Read => {
                    let got = op.done;
                    return self.finish(
                        op,
                        Err(NvmeError::ShortRead {
                            offset,
                            expected: len,
                            got,
                        }),
                    );
                }
                OpKind::Write => {
                    op.stalls += 1;
                    if op.stalls > MAX_STALLS {
                        let got = op.done;
                        return self.finish(
                            op,
                            Err(NvmeError::ShortWrite {
                                offset,
                                expected: len,
                                got,
                            }),
                        );
                    }
                    self.pending.push_front(op);
                    return;
                }
            }
        }
        op.done += n.min(len - op.done);
        op.stalls = 0;
        if op.done < len {
            self.counters
                .resubmits_short
                .fetch_add(1, Ordering::Relaxed);
            self.pending.push_front(op);
            return;
        }
        self.finish(op, Ok(()))
    }

    fn finish(&mut self, op: Op, result: Result<(), NvmeError>) {
        self.counters.ops.fetch_add(1, Ordering::Relaxed);
        let Some(state) = self.batches[op.batch].as_mut() else {
            return;
        };
        state.results[op.index] = Some(op.req.complete(result));
        state.remaining -= 1;
        if state.remaining == 0 {
            let state = self.batches[op.batch].take().expect("checked above");
            self.free_batches.push(op.batch);
            let results: Vec<IoCompletion> = state
                .results
                .into_iter()
                .map(|r| r.expect("all completed"))
                .collect();
            // A caller that went away just drops its buffers.
            let _ = state.reply.send(results);
        }
    }
}
