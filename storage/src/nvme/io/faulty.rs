//! A fault-injecting wrapper around any driver, for tests: short transfers, EIO, ENOSPC, bit
//! flips and stalls, chosen per operation kind by probability, operation count or file offset,
//! deterministic for a given seed and submission order (offset rules for any order).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::{IoCompletion, IoDriver, IoRequest, OpKind};
use crate::nvme::buf::AlignedBuf;
use crate::nvme::NvmeError;

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A read returns only a prefix (the rest zeroed) and reports `ShortRead`; a write stores
    /// only an aligned prefix (a torn write) and reports `ShortWrite`.
    ShortTransfer,
    /// The operation is not performed and fails with EIO.
    Eio,
    /// The operation is not performed and fails with ENOSPC.
    Enospc,
    /// Silent corruption: one bit flipped in the data read, or in the data stored on a write
    /// (the caller's buffer is restored). Reported as success.
    BitFlip,
    /// A slow device: the operation succeeds, but holds the device this much longer. The
    /// stalled operations of a batch take their stalls one after another, before the batch
    /// reaches the wrapped driver, and count as in flight from the start of their stall.
    Stall(Duration),
}

/// When a rule fires. Counts are per rule, over the operations the rule's kind matches,
/// starting at 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Trigger {
    Always,
    /// Each matching operation independently with this probability.
    Probability(f64),
    /// Only the n-th matching operation.
    Nth(u64),
    /// Every n-th matching operation.
    EveryNth(u64),
    /// Every matching operation at this file offset (on any file): a fault pinned to one
    /// page, whatever the order in which concurrent batches reach the driver.
    AtOffset(u64),
}

/// One injection rule. The first rule that fires for an operation wins.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultRule {
    /// `None` matches reads and writes.
    pub kind: Option<OpKind>,
    pub fault: Fault,
    pub trigger: Trigger,
}

struct State {
    rng: SplitMix64,
    seen: Vec<u64>,
}

/// Wraps `E`, injecting faults according to its rules.
pub struct FaultyDriver<E> {
    inner: E,
    rules: Vec<FaultRule>,
    state: Mutex<State>,
    injected: AtomicU64,
}

/// splitmix64: tiny, seedable, good enough to pick faults.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

impl<E: IoDriver> FaultyDriver<E> {
    pub fn new(inner: E, rules: Vec<FaultRule>, seed: u64) -> Result<Self, NvmeError> {
        for r in &rules {
            match r.trigger {
                Trigger::Probability(p) if !(0.0..=1.0).contains(&p) => {
                    return Err(NvmeError::invalid(format!(
                        "fault probability {p} is outside [0, 1]"
                    )))
                }
                Trigger::Nth(0) | Trigger::EveryNth(0) => {
                    return Err(NvmeError::invalid("fault op counts start at 1"))
                }
                _ => {}
            }
        }
        let n = rules.len();
        Ok(Self {
            inner,
            rules,
            state: Mutex::new(State {
                rng: SplitMix64(seed),
                seen: vec![0; n],
            }),
            injected: AtomicU64::new(0),
        })
    }

    /// How many faults were injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    pub fn inner(&self) -> &E {
        &self.inner
    }
}

enum Plan {
    Pass,
    Stall,
    Fail(Fault),
    FlipRead { bit: u64 },
    FlipWrite { bit: u64 },
    ShortRead { keep: usize },
    ShortWrite { keep: usize, full: AlignedBuf },
}

impl<E: IoDriver> IoDriver for FaultyDriver<E> {
    fn submit(&self, reqs: Vec<IoRequest>) -> Result<Vec<IoCompletion>, NvmeError> {
        let mut plans = Vec::with_capacity(reqs.len());
        let mut inner_reqs = Vec::with_capacity(reqs.len());
        let mut immediate: Vec<Option<IoCompletion>> = Vec::with_capacity(reqs.len());
        let mut stall = Duration::ZERO;
        {
            let mut st = self.state.lock();
            for mut req in reqs {
                let fault = self.decide(&mut st, req.kind(), req.offset());
                let align = req.file().offset_align();
                let len = req.len();
                let plan = match (fault, req.kind()) {
                    (None, _) => Plan::Pass,
                    (Some(Fault::Stall(d)), _) => {
                        req.mark_started();
                        stall += d;
                        Plan::Stall
                    }
                    (Some(f @ (Fault::Eio | Fault::Enospc)), _) => Plan::Fail(f),
                    (Some(Fault::BitFlip), OpKind::Read) => Plan::FlipRead {
                        bit: st.rng.below(len as u64 * 8),
                    },
                    (Some(Fault::BitFlip), OpKind::Write) => {
                        let bit = st.rng.below(len as u64 * 8);
                        flip(&mut req, bit);
                        Plan::FlipWrite { bit }
                    }
                    (Some(Fault::ShortTransfer), OpKind::Read) => {
                        // Any byte count short of the whole: the driver contract is that
                        // this never surfaces as success.
                        let keep = st.rng.below(len as u64) as usize;
                        Plan::ShortRead { keep }
                    }
                    (Some(Fault::ShortTransfer), OpKind::Write) => {
                        let keep = st.rng.below((len / align) as u64) as usize * align;
                        if keep == 0 {
                            Plan::Fail(Fault::ShortTransfer)
                        } else {
                            let mut part = AlignedBuf::new(keep, req.buf().align())?;
                            part.copy_from_slice(&req.buf()[..keep]);
                            let full = std::mem::replace(req.buf_mut(), part);
                            Plan::ShortWrite { keep, full }
                        }
                    }
                };
                if fault.is_some() {
                    self.injected.fetch_add(1, Ordering::Relaxed);
                }
                match plan {
                    Plan::Fail(f) => {
                        let (kind, offset) = (req.kind(), req.offset());
                        let err = match f {
                            Fault::Eio => NvmeError::Io {
                                kind,
                                offset,
                                len,
                                source: io::Error::from_raw_os_error(libc::EIO),
                            },
                            Fault::Enospc => NvmeError::NoSpace { offset, len },
                            _ => match kind {
                                OpKind::Read => NvmeError::ShortRead {
                                    offset,
                                    expected: len,
                                    got: 0,
                                },
                                OpKind::Write => NvmeError::ShortWrite {
                                    offset,
                                    expected: len,
                                    got: 0,
                                },
                            },
                        };
                        immediate.push(Some(req.complete(Err(err))));
                        plans.push(Plan::Pass);
                    }
                    p => {
                        immediate.push(None);
                        plans.push(p);
                        inner_reqs.push(req);
                    }
                }
            }
        }
        if !stall.is_zero() {
            std::thread::sleep(stall);
        }
        let mut inner_done = self.inner.submit(inner_reqs)?.into_iter();
        let mut out = Vec::with_capacity(immediate.len());
        for (imm, plan) in immediate.into_iter().zip(plans) {
            if let Some(c) = imm {
                out.push(c);
                continue;
            }
            let mut c = inner_done.next().ok_or(NvmeError::DriverStopped)?;
            match plan {
                Plan::Pass | Plan::Stall | Plan::Fail(_) => {}
                Plan::FlipRead { bit } => {
                    if c.result.is_ok() {
                        c.buf[(bit / 8) as usize] ^= 1 << (bit % 8);
                    }
                }
                Plan::FlipWrite { bit } => {
                    c.buf[(bit / 8) as usize] ^= 1 << (bit % 8);
                }
                Plan::ShortRead { keep } => {
                    if c.result.is_ok() {
                        c.buf[keep..].fill(0);
                        c.result = Err(NvmeError::ShortRead {
                            offset: c.offset,
                            expected: c.buf.len(),
                            got: keep,
                        });
                    }
                }
                Plan::ShortWrite { keep, full } => {
                    let expected = full.len();
                    c.result = Err(match c.result {
                        Ok(()) => NvmeError::ShortWrite {
                            offset: c.offset,
                            expected,
                            got: keep,
                        },
                        Err(e) => e,
                    });
                    c.buf = full;
                }
            }
            out.push(c);
        }
        Ok(out)
    }

    fn name(&self) -> &'static str {
        "faulty"
    }
}

impl<E> FaultyDriver<E> {
    fn decide(&self, st: &mut State, kind: OpKind, offset: u64) -> Option<Fault> {
        let mut chosen = None;
        for (i, r) in self.rules.iter().enumerate() {
            if r.kind.is_some_and(|k| k != kind) {
                continue;
            }
            st.seen[i] += 1;
            let n = st.seen[i];
            // Draw for every probability rule so the sequence does not depend on which
            // earlier rule fired.
            let fire = match r.trigger {
                Trigger::Always => true,
                Trigger::Probability(p) => st.rng.unit() < p,
                Trigger::Nth(k) => n == k,
                Trigger::EveryNth(k) => n.is_multiple_of(k),
                Trigger::AtOffset(at) => offset == at,
            };
            if fire && chosen.is_none() {
                chosen = Some(r.fault);
            }
        }
        chosen
    }
}

fn flip(req: &mut IoRequest, bit: u64) {
    req.buf_mut()[(bit / 8) as usize] ^= 1 << (bit % 8);
}
