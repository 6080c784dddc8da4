//! Host-tier compaction: a request whose runs fit in the free bytes but in no free range
//! (the tier is fragmented) gets its room by moving other sessions' runs inside the arena,
//! never by demoting anyone ([`kvtier_storage::HostArena::plan_relocation`]).

use std::collections::{HashMap, HashSet};

use super::*;

impl Service {
    /// Makes `wanted` runs of `run_bytes` fit in the host tier by moving runs when the free
    /// bytes hold them but no free range does. Only runs of sessions it can lock without
    /// waiting and that no engine process holds the addresses of (no LEASE, no RESERVE) move;
    /// the caller's own sessions are locked by it, so they stay. Returns whether the runs fit.
    pub(super) fn compact_host(&self, wanted: usize, run_bytes: usize) -> bool {
        let arena = &self.arena;
        if arena.fits(run_bytes, wanted) >= wanted {
            return true;
        }
        let extent = kvtier_storage::arena::extent_bytes(run_bytes);
        let u = arena.usage();
        if u.bytes_total - u.bytes_used < wanted * extent {
            return false;
        }
        let sessions: Vec<Arc<Session>> = self.sessions.read().values().cloned().collect();
        let mut locked: Vec<MutexGuard<'_, SessionState>> = sessions
            .iter()
            .filter(|s| s.leases() == 0)
            .filter_map(|s| s.state.try_lock())
            .filter(|st| st.reserved.is_none() && !st.closed)
            .collect();
        // Where each movable run is: offset -> (locked session, layer, block).
        let mut owner: HashMap<usize, (usize, u32, u32)> = HashMap::new();
        for (i, st) in locked.iter().enumerate() {
            owner.extend(st.kv.resident_runs().map(|(l, b, off)| (off, (i, l, b))));
        }
        let mut movable: HashSet<usize> = owner.keys().copied().collect();
        // Each placed run's room is held until all are placed, so the next plan cannot take it.
        let mut held = Vec::with_capacity(wanted);
        let mut moved = 0u64;
        while held.len() < wanted {
            if let Ok(room) = arena.alloc(run_bytes) {
                held.push(room);
                continue;
            }
            let Some(plan) = arena.plan_relocation(run_bytes, &movable) else {
                break;
            };
            for (from, to) in plan.moves {
                let (i, l, b) = owner
                    .remove(&from)
                    .expect("a planned move is of a movable run");
                movable.remove(&from);
                let at = to.offset();
                // Every movable run's session is locked here, so the run is where it was.
                if locked[i].kv.move_run(l, b, from, to).is_ok() {
                    owner.insert(at, (i, l, b));
                    movable.insert(at);
                    moved += 1;
                }
            }
        }
        drop(locked);
        self.counters
            .host_runs_moved
            .fetch_add(moved, Ordering::Relaxed);
        if moved > 0 {
            tracing::info!(
                runs = moved,
                run_bytes,
                wanted,
                placed = held.len(),
                "moved host runs to place a fragmented request"
            );
        }
        held.len() == wanted
    }
}
