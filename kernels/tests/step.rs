//! The one decode step with a backend that selects by itself (as the GPU does), checked against
//! the CPU step: what it selects on the CPU and promotes before the append, the cold tail, the
//! CPU answer after a failure or a divergence. No device: the backend here attends on the CPU
//! over its own selection of the appended layer, which is what a device does.

use kvtier_kernels::{
    decode_cpu, decode_step, Appended, Attended, Backend, DecodeEntry, KeepSet, KernelError,
    SelectScratch, StageTimings, StepReport, StepStats,
};
use kvtier_storage::testing::{Rng, SavedRuns};
use kvtier_storage::{
    ArenaOptions, ColdSource, Geometry, HostArena, KvCache, Policy, StorageError,
};

/// One (layer, block) run fills a 4 KiB extent.
const GEO: Geometry = kvtier_tests::session::SMALL_GEOMETRY;

const POLICY: Policy = Policy::bound(1, 2, 3);

fn arena() -> HostArena {
    HostArena::new(&ArenaOptions::new(16 << 20, 4096)).unwrap()
}

fn row(rng: &mut Rng) -> Vec<u8> {
    GEO.dtype
        .encode_vec(&rng.normals((GEO.kv_heads * GEO.head_dim) as usize))
}

/// Two copies of one session of `tokens` tokens.
fn twins(tokens: u64, rng: &mut Rng) -> (KvCache, KvCache) {
    let n = tokens as usize * (GEO.kv_heads * GEO.head_dim) as usize;
    let mut payload = Vec::new();
    for _ in 0..2 * GEO.layers {
        payload.extend(GEO.dtype.encode_vec(&rng.normals(n)));
    }
    let mut a = KvCache::new(GEO, arena()).unwrap();
    let mut b = KvCache::new(GEO, arena()).unwrap();
    a.append(0, tokens, &payload).unwrap();
    b.append(0, tokens, &payload).unwrap();
    (a, b)
}

/// A backend that selects by itself from the appended layer, like the device; records what
/// the step planned. `fail`: fails after the appends; `leave_cold`: the testing aid.
#[derive(Default)]
struct SelfSelecting {
    planned: Vec<Option<KeepSet>>,
    fail: bool,
    #[cfg_attr(not(any(debug_assertions, feature = "test-hooks")), allow(dead_code))]
    leave_cold: u32,
    discarded: Vec<u64>,
}

impl Backend for SelfSelecting {
    fn selects_itself(&self) -> bool {
        true
    }

    fn attend(
        &mut self,
        b: &Appended<'_, '_>,
        out: &mut [f32],
    ) -> kvtier_kernels::Result<Attended> {
        let entries = b.entries;
        self.planned = b.planned.to_vec();
        if self.fail {
            return Err(KernelError::Unavailable {
                reason: "injected device failure".into(),
            });
        }
        let mut scratch = SelectScratch::default();
        let mut keeps = Vec::new();
        for e in entries {
            keeps.push(e.select(&mut scratch)?);
        }
        // Attends whatever it selected, cold or not (a device reads the zero extent there).
        let views: Vec<_> = entries
            .iter()
            .map(|e| e.kv.layer(e.layer).unwrap())
            .collect();
        let resident: Vec<KeepSet> = keeps
            .iter()
            .zip(entries)
            .map(|(k, e)| {
                let cold = e.kv.cold_among(e.layer, &k.union());
                let mut r = KeepSet::new();
                for h in 0..k.heads() {
                    r.push_head(k.head(h).iter().copied().filter(|b| !cold.contains(b)));
                }
                r
            })
            .collect();
        kvtier_kernels::attention::attend_keep_sets(
            entries.iter().map(|e| e.q),
            &views,
            &resident,
            out,
        );
        Ok(Attended {
            keeps: keeps.into_iter().map(Some).collect(),
            ..Attended::default()
        })
    }

    fn discard(&mut self, sessions: &[u64]) {
        self.discarded.extend_from_slice(sessions);
    }

    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    fn take_leave_cold(&mut self) -> u32 {
        std::mem::take(&mut self.leave_cold)
    }
}

/// The storage error at the root of a step's error.
fn storage(e: &KernelError) -> &StorageError {
    match e.root() {
        KernelError::Storage(s) => s,
        other => panic!("not a storage error: {other}"),
    }
}

fn entry<'a>(
    kv: &'a mut KvCache,
    position: u64,
    q: &'a [f32],
    kv_row: &'a [u8],
    cold: Option<&'a dyn ColdSource>,
) -> DecodeEntry<'a> {
    DecodeEntry {
        session: 1,
        layer: 0,
        kv,
        policy: POLICY,
        position,
        q,
        k: kv_row,
        v: kv_row,
        cold,
    }
}

/// The next step of layer 0 of `hot` on the CPU, the reference: a random query and new row,
/// the position, and the CPU step's output and stats.
fn reference(
    hot: &mut KvCache,
    rng: &mut Rng,
) -> (Vec<f32>, Vec<u8>, u64, Vec<f32>, Vec<StepStats>) {
    let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
    let r = row(rng);
    let pos = hot.tokens(0).unwrap();
    let mut out = vec![0f32; q.len()];
    let stats = decode_cpu(&mut [entry(hot, pos, &q, &r, None)], &mut out).unwrap();
    (q, r, pos, out, stats)
}

/// The decode step of layer 0 over the one entry `e`, its output in `out`.
fn step_one(
    be: &mut dyn Backend,
    e: DecodeEntry<'_>,
    out: &mut [f32],
    want_keep: bool,
) -> Result<StepReport, KernelError> {
    decode_step(be, &mut [e], out, want_keep, &mut StageTimings::default())
}

#[test]
fn a_self_selecting_backend_gets_the_cpu_keep_set_of_cold_layers_promoted_first() {
    let mut rng = Rng::new(11);
    // Below the budget, at it, full and partial tails, and long enough for the parallel
    // scoring branch (200 blocks x 2 heads).
    for tokens in [
        20u64,
        6 * 16,
        6 * 16 + 1,
        40 * 16,
        40 * 16 + 7,
        200 * 16 + 3,
    ] {
        let (mut hot, mut cold) = twins(tokens, &mut rng);
        let saved = SavedRuns::of(&cold);
        for step in 0..6 {
            let blocks = cold.layer(0).unwrap().blocks() as u32;
            // Every other block cold, never the tail.
            for b in (0..blocks - 1).step_by(2) {
                cold.evict(0, b);
            }
            let (q, r, pos, out_cpu, cpu) = reference(&mut hot, &mut rng);
            let before: Vec<u32> = (0..blocks).filter(|&b| !cold.is_resident(0, b)).collect();
            let mut be = SelfSelecting::default();
            let mut out = vec![0f32; q.len()];
            let e = entry(&mut cold, pos, &q, &r, Some(&saved));
            let rep = step_one(&mut be, e, &mut out, false).unwrap();
            let plan = be.planned[0].as_ref().expect("the layer had cold blocks");
            assert_eq!(
                Some(plan),
                cpu[0].keep.as_ref(),
                "{tokens} tokens, step {step}"
            );
            let union = plan.union();
            let read: Vec<u32> = before
                .iter()
                .copied()
                .filter(|b| union.contains(b))
                .collect();
            assert_eq!(rep.entries[0].blocks_promoted as usize, read.len());
            assert!(union.iter().all(|&b| cold.is_resident(0, b)));
            if tokens >= 40 * 16 {
                assert!(
                    union.len() < blocks as usize,
                    "a top-k step must not promote everything"
                );
            }
            assert!(!rep.cpu_fallback && rep.cold_divergences == 0);
            assert_eq!(out, out_cpu, "same keep-set, same output");
            assert_eq!(rep.entries[0].tiles_selected, cpu[0].tiles_selected);
            assert_eq!(rep.entries[0].bytes_touched, cpu[0].bytes_touched);
        }
    }
}

#[test]
fn a_resident_layer_is_not_selected_on_the_cpu_for_a_self_selecting_backend() {
    let mut rng = Rng::new(12);
    let (_, mut kv) = twins(50, &mut rng);
    let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
    let r = row(&mut rng);
    let mut be = SelfSelecting::default();
    let mut out = vec![0f32; q.len()];
    kv.evict(1, 0); // another layer's cold block does not matter
    step_one(&mut be, entry(&mut kv, 50, &q, &r, None), &mut out, true).unwrap();
    assert_eq!(be.planned, vec![None]);
}

#[test]
fn a_cold_partial_tail_is_promoted_before_the_append_or_refused_with_nothing_changed() {
    let mut rng = Rng::new(13);
    let (_, mut kv) = twins(40, &mut rng); // 3 blocks, the tail holds 8 tokens
    let saved = SavedRuns::of(&kv);
    let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
    let r = row(&mut rng);
    let mut out = vec![0f32; q.len()];
    let mut step = |kv: &mut KvCache, pos: u64, cold: Option<&dyn ColdSource>| {
        step_one(
            &mut SelfSelecting::default(),
            entry(kv, pos, &q, &r, cold),
            &mut out,
            false,
        )
    };
    assert!(kv.evict(0, 2));
    // No colder tier: a typed refusal, nothing appended.
    let e = step(&mut kv, 40, None).unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::NotResident { layer: 0, .. }),
        "{e}"
    );
    assert_eq!((kv.tokens(0).unwrap(), kv.is_resident(0, 2)), (40, false));
    // A wrong position reads nothing (the append check reports it).
    let e = step(&mut kv, 39, Some(&saved)).unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::PositionMismatch { .. }),
        "{e}"
    );
    assert!(!kv.is_resident(0, 2));
    // A failed read is the typed storage error and changes nothing.
    let empty = SavedRuns::default();
    let e = step(&mut kv, 40, Some(&empty)).unwrap_err();
    assert!(
        matches!(storage(&e), StorageError::ColdRead { block: 2, .. }),
        "{e}"
    );
    assert_eq!((kv.tokens(0).unwrap(), kv.is_resident(0, 2)), (40, false));
    // With the tier: read back, then appended into.
    let rep = step(&mut kv, 40, Some(&saved)).unwrap();
    assert!(rep.entries[0].blocks_promoted >= 1);
    assert_eq!(kv.tokens(0).unwrap(), 41);
    assert!(kv.is_resident(0, 2));
}

#[test]
fn after_a_failure_or_a_divergence_the_cpu_answers_and_the_device_state_is_discarded() {
    let mut rng = Rng::new(14);
    // A divergence needs the test hook (debug builds, or the test-hooks feature).
    let hooks = cfg!(any(debug_assertions, feature = "test-hooks"));
    for diverge in [false, hooks] {
        let (mut hot, mut cold) = twins(40 * 16 + 5, &mut rng);
        let saved = SavedRuns::of(&cold);
        for b in 1..39 {
            cold.evict(0, b);
        }
        let (q, r, pos, out_cpu, cpu) = reference(&mut hot, &mut rng);
        let mut be = SelfSelecting {
            fail: !diverge,
            leave_cold: if diverge { 2 } else { 0 },
            ..SelfSelecting::default()
        };
        let mut out = vec![0f32; q.len()];
        let e = entry(&mut cold, pos, &q, &r, Some(&saved));
        let rep = step_one(&mut be, e, &mut out, true).unwrap();
        assert!(rep.cpu_fallback, "diverge {diverge}");
        assert_eq!(rep.cold_divergences, u32::from(diverge));
        assert_eq!(be.discarded, vec![1]);
        assert_eq!(out, out_cpu, "the CPU's answer over the CPU keep-set");
        assert_eq!(rep.entries[0].keep, cpu[0].keep);
        assert_eq!(cold.tokens(0).unwrap(), pos + 1, "appended once");
        assert!(cpu[0]
            .keep
            .as_ref()
            .unwrap()
            .union()
            .iter()
            .all(|&b| cold.is_resident(0, b)));
    }
}

#[test]
fn stats_count_the_same_on_every_backend() {
    // Below the budget every block is kept; above, the budget; only the tail is partial.
    for tokens in [1u64, 15, 16, 17, 6 * 16, 6 * 16 + 1, 100 * 16 + 9] {
        let s = kvtier_kernels::decode::stats(&GEO, &POLICY, tokens);
        let blocks = GEO.blocks_for(tokens);
        let per_head = blocks.min(POLICY.budget());
        assert_eq!(s.blocks_total as u64, blocks);
        assert_eq!(s.tiles_selected as u64, per_head * 2);
        let tail = tokens - (blocks - 1) * 16;
        let rows = 2 * ((per_head - 1) * 16 + tail);
        assert_eq!(
            s.bytes_touched,
            blocks * 2 * 2 * 32 * 4 + rows * 2 * 32 * 2,
            "{tokens}"
        );
    }
}
