//! The decoder as the one decode step's [`Backend`]: checks a batch against the open sessions,
//! then groups its entries by lane and runs each lane's device calls on its own thread.

use super::*;

/// The device behind the one decode step (`kvtier_kernels::decode_step`): it selects by itself,
/// so the step selects on the CPU only for layers with cold blocks (see the module docs).
/// Implemented on a shared reference: a step locks only the lanes of its sessions.
impl Backend for &GpuDecoder {
    fn selects_itself(&self) -> bool {
        true
    }

    /// Every session open here, each once, with the geometry it was opened with, and the
    /// layers within the device capacity.
    fn check(&self, entries: &[DecodeEntry<'_>]) -> kvtier_kernels::Result<()> {
        let unavailable = |i: usize, e: GpuError| KernelError::Unavailable {
            reason: format!("batch entry {i}: {e}"),
        };
        for (i, e) in entries.iter().enumerate() {
            if entries[..i].iter().any(|b| b.session == e.session) {
                return Err(unavailable(
                    i,
                    GpuError::DuplicateSession { session: e.session },
                ));
            }
        }
        let lanes = self
            .by_lane(entries.iter().map(|e| e.session))
            .map_err(|(i, e)| unavailable(i, e))?;
        for (l, idx) in lanes {
            let lane = self.lanes[l].lock();
            for i in idx {
                lane.check(&entries[i]).map_err(|e| unavailable(i, e))?;
            }
        }
        Ok(())
    }

    /// One device call per lane (and backend) of the batch; the lanes' calls at once, each
    /// on its own thread, when the batch spans several.
    fn attend(
        &mut self,
        b: &Appended<'_, '_>,
        out: &mut [f32],
    ) -> kvtier_kernels::Result<Attended> {
        let failed = |e: GpuError| KernelError::Unavailable {
            reason: format!("device step failed after the appends: {e}"),
        };
        let dec: &GpuDecoder = self;
        let lanes = dec
            .by_lane(b.entries.iter().map(|e| e.session))
            .map_err(|(_, e)| failed(e))?;
        let items: Vec<Item<'_>> = b
            .entries
            .iter()
            .map(|e| Item {
                session: e.session,
                layer: e.layer,
                kv: &*e.kv,
                q: e.q,
            })
            .collect();
        let checked: Vec<bool> = b.planned.iter().map(Option::is_some).collect();
        let run = |l: usize, idx: &[usize], out: &mut [f32]| {
            let its: Vec<Item<'_>> = idx.iter().map(|&i| items[i]).collect();
            let chk: Vec<bool> = idx.iter().map(|&i| checked[i]).collect();
            dec.lanes[l].lock().run_device(&its, out, b.want_keep, &chk)
        };
        if let [(l, _)] = lanes.as_slice() {
            // One lane: the whole batch, in its order, written in place.
            return dec.lanes[*l]
                .lock()
                .run_device(&items, out, b.want_keep, &checked)
                .map_err(failed);
        }
        let width = |i: usize| {
            let g = items[i].kv.geometry();
            (g.q_heads * g.head_dim) as usize
        };
        let parts: Vec<Result<(Attended, Vec<f32>), GpuError>> = std::thread::scope(|sc| {
            let handles: Vec<_> = lanes
                .iter()
                .map(|(l, idx)| {
                    let run = &run;
                    let len = idx.iter().map(|&i| width(i)).sum();
                    sc.spawn(move || {
                        let mut o = vec![0f32; len];
                        run(*l, idx, &mut o).map(|a| (a, o))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(GpuError::Unsupported {
                            reason: "a lane's device call panicked".into(),
                        })
                    })
                })
                .collect()
        });
        let mut offsets = vec![0usize; items.len() + 1];
        for i in 0..items.len() {
            offsets[i + 1] = offsets[i] + width(i);
        }
        let mut result = Attended {
            keeps: vec![None; items.len()],
            ..Attended::default()
        };
        for ((_, idx), part) in lanes.iter().zip(parts) {
            let (a, o) = part.map_err(failed)?;
            let mut at = 0;
            for (j, &i) in idx.iter().enumerate() {
                let n = width(i);
                out[offsets[i]..offsets[i] + n].copy_from_slice(&o[at..at + n]);
                at += n;
                result.keeps[i] = a.keeps[j].clone();
            }
            result.cache_hits += a.cache_hits;
            result.cache_misses += a.cache_misses;
            result.bytes_moved += a.bytes_moved;
        }
        Ok(result)
    }

    fn discard(&mut self, sessions: &[u64]) {
        for &s in sessions {
            if let Some(l) = self.lane_of(s) {
                self.lanes[l].lock().reset_session(s);
            }
        }
    }

    #[cfg(any(debug_assertions, feature = "test-faults"))]
    fn take_leave_cold(&mut self) -> u32 {
        self.leave_cold
            .swap(0, std::sync::atomic::Ordering::Relaxed)
    }
}
