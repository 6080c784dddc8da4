//! The one decode step (`kvtier_kernels::decode_step`) on the GpuDecoder against the same step
//! on the CPU (`kvtier_kernels::decode_cpu`): the same sessions,
//! appended and decoded through both, select identical keep-sets and give outputs within
//! 2e-3 relative error — also when the GPU copy's blocks are mostly on NVMe (a real page
//! store on files in a temporary directory) and the all-RAM CPU copy is the reference.
//! Every test is `#[ignore]`d with the reason (a machine without a GPU reports it as ignored);
//! bench/gpu/run.sh runs them with `--include-ignored`; without a device each prints "skipped: no
//! CUDA device" and passes.
#![cfg(feature = "cuda")]

use std::path::Path;

use kvtier_kernels::{decode_cpu, decode_step, DecodeEntry, KernelError, StageTimings, StepReport};
use kvtier_storage::nvme::io::UringConfig;
use kvtier_storage::nvme::manifest::SessionRecord;
use kvtier_storage::nvme::{
    open_best_driver, BlockRun, DeviceConfig, NvmeTier, PageStore, PageStoreConfig, TierSource,
};
use kvtier_storage::testing::Rng;
use kvtier_storage::{
    ArenaOptions, ColdSource, DType, Geometry, HostArena, KvCache, Policy, StorageError,
};
use tierd::gpu::{GpuDecoder, GpuError, GpuSettings};

/// One step of `layer` (every entry's) on the device through the one decode step.
fn gpu_step(
    dec: &GpuDecoder,
    layer: u32,
    entries: &mut [DecodeEntry<'_>],
    out: &mut [f32],
    want_keep: bool,
) -> Result<StepReport, KernelError> {
    for e in entries.iter_mut() {
        e.layer = layer;
    }
    decode_step(
        &mut &*dec,
        entries,
        out,
        want_keep,
        &mut StageTimings::default(),
    )
}

fn gpu() -> bool {
    if kvtier_kernels::cuda::device_available() {
        true
    } else {
        println!("skipped: no CUDA device");
        false
    }
}

const _: () = {
    const fn send<T: Send>() {}
    send::<GpuDecoder>();
};

/// Qwen2.5-7B heads (28/4, D=128, bf16) with 16-token blocks, so a few dozen steps cross
/// block boundaries.
const GEO: Geometry = Geometry {
    layers: 2,
    q_heads: 28,
    kv_heads: 4,
    head_dim: 128,
    dtype: DType::Bf16,
    block_tokens: 16,
};

/// The default selector's (sketches); [`BOUND`] for the key-bound selector.
const POLICY: Policy = Policy::sketch(1, 4, 8, 16);
const BOUND: Policy = Policy::bound(1, 4, 8);

/// Two arenas of `mib` MiB (the GPU copy's and the CPU copy's) and a decoder over the first;
/// None (the test passes, saying so) without a CUDA device.
fn start(mib: usize) -> Option<(HostArena, HostArena, GpuDecoder)> {
    if !gpu() {
        return None;
    }
    let (ga, ca) = (arena(mib), arena(mib));
    let dec = GpuDecoder::new(&ga, &settings()).unwrap();
    Some((ga, ca, dec))
}

/// [`start`], and an NVMe tier on a page file in a temporary directory (returned first, so it
/// is removed last).
fn start_with_tier(
    mib: usize,
) -> Option<(
    tempfile::TempDir,
    NvmeTier,
    HostArena,
    HostArena,
    GpuDecoder,
)> {
    let (ga, ca, dec) = start(mib)?;
    let dir = tempfile::tempdir().unwrap();
    let tier = nvme_tier(dir.path());
    Some((dir, tier, ga, ca, dec))
}

fn arena(mib: usize) -> HostArena {
    HostArena::new(&ArenaOptions::new(mib << 20, GEO.block_bytes())).unwrap()
}

fn settings() -> GpuSettings {
    GpuSettings {
        max_sessions: 8,
        max_blocks: 64,
        // Batches of 8 are split into two device calls.
        max_batch: 4,
        // One lane: every session's slot in one backend (lanes have their own test).
        lanes: 1,
        ..GpuSettings::default()
    }
}

/// One session held twice: `gpu` in the registered arena, `cpu` (the reference) elsewhere.
struct Twin {
    id: u64,
    policy: Policy,
    gpu: KvCache,
    cpu: KvCache,
}

fn random_kv(rng: &mut Rng, n: u64) -> Vec<u8> {
    let per_layer = n as usize * GEO.kv_heads as usize * GEO.head_dim as usize;
    let mut payload = Vec::new();
    for _ in 0..GEO.layers {
        payload.extend(GEO.dtype.encode_vec(&rng.normals(per_layer)));
        payload.extend(GEO.dtype.encode_vec(&rng.normals(per_layer)));
    }
    payload
}

fn twin(
    dec: &GpuDecoder,
    ga: &HostArena,
    ca: &HostArena,
    id: u64,
    tokens: u64,
    rng: &mut Rng,
) -> Twin {
    twin_with(dec, (ga, ca), id, tokens, rng, POLICY)
}

fn twin_with(
    dec: &GpuDecoder,
    (ga, ca): (&HostArena, &HostArena),
    id: u64,
    tokens: u64,
    rng: &mut Rng,
    policy: Policy,
) -> Twin {
    let mut gpu = KvCache::new(GEO, ga.clone()).unwrap();
    let mut cpu = KvCache::new(GEO, ca.clone()).unwrap();
    let payload = random_kv(rng, tokens);
    gpu.append(0, tokens, &payload).unwrap();
    cpu.append(0, tokens, &payload).unwrap();
    dec.open(id, &GEO, &policy).unwrap();
    Twin {
        id,
        policy,
        gpu,
        cpu,
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert!(got.iter().all(|x| x.is_finite()), "non-finite GPU output");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// One entry of a step: session `id`'s copy `kv` at the position, with the query and new K/V.
fn batch_entry<'a>(
    (id, policy): (u64, Policy),
    layer: u32,
    kv: &'a mut KvCache,
    (position, q, k, v): (u64, &'a [f32], &'a [u8], &'a [u8]),
    cold: Option<&'a dyn ColdSource>,
) -> DecodeEntry<'a> {
    DecodeEntry {
        session: id,
        layer,
        kv,
        policy,
        position,
        q,
        k,
        v,
        cold,
    }
}

/// One decode step of every layer for `twins` through both paths, the GPU entries reading
/// cold blocks from `tier` when given: identical keep-sets, outputs within 2e-3, every
/// keep-set block resident afterwards. Returns the GPU outputs, one per layer.
fn step_both_cold(
    dec: &GpuDecoder,
    twins: &mut [Twin],
    rng: &mut Rng,
    tier: Option<&NvmeTier>,
) -> Vec<StepReport> {
    let hqd = (GEO.q_heads * GEO.head_dim) as usize;
    let row = GEO.kv_heads as usize * GEO.head_dim as usize;
    let mut results = Vec::new();
    for layer in 0..GEO.layers {
        let qs: Vec<Vec<f32>> = twins.iter().map(|_| rng.normals(hqd)).collect();
        let ks: Vec<Vec<u8>> = twins
            .iter()
            .map(|_| GEO.dtype.encode_vec(&rng.normals(row)))
            .collect();
        let vs: Vec<Vec<u8>> = twins
            .iter()
            .map(|_| GEO.dtype.encode_vec(&rng.normals(row)))
            .collect();
        let positions: Vec<u64> = twins.iter().map(|t| t.cpu.tokens(layer).unwrap()).collect();
        let mut cpu_out = vec![0f32; twins.len() * hqd];
        let mut gpu_out = vec![f32::NAN; twins.len() * hqd];
        let input = |i: usize| (positions[i], &qs[i][..], &ks[i][..], &vs[i][..]);
        let cpu_stats = {
            let mut entries: Vec<DecodeEntry<'_>> = twins
                .iter_mut()
                .enumerate()
                .map(|(i, t)| batch_entry((t.id, t.policy), layer, &mut t.cpu, input(i), None))
                .collect();
            decode_cpu(&mut entries, &mut cpu_out).unwrap()
        };
        let sources: Vec<Option<TierSource<'_>>> = twins
            .iter()
            .map(|t| {
                tier.map(|tier| TierSource {
                    tier,
                    session: t.id,
                })
            })
            .collect();
        let gpu_res = {
            let mut entries: Vec<DecodeEntry<'_>> = twins
                .iter_mut()
                .zip(&sources)
                .enumerate()
                .map(|(i, (t, src))| {
                    let cold = src.as_ref().map(|c| c as &dyn ColdSource);
                    batch_entry((t.id, t.policy), layer, &mut t.gpu, input(i), cold)
                })
                .collect();
            gpu_step(dec, layer, &mut entries, &mut gpu_out, true).unwrap()
        };
        for (i, t) in twins.iter().enumerate() {
            let (c, g) = (&cpu_stats[i], &gpu_res.entries[i]);
            let keep = g.keep.as_ref().unwrap();
            assert_eq!(
                Some(keep),
                c.keep.as_ref(),
                "keep-set of session {} layer {layer} at {}",
                t.id,
                positions[i]
            );
            assert_eq!(g.blocks_total, c.blocks_total);
            assert_eq!(g.tiles_selected, c.tiles_selected);
            assert_eq!(g.bytes_touched, c.bytes_touched, "counted once, alike");
            let e = rel_err(
                &gpu_out[i * hqd..(i + 1) * hqd],
                &cpu_out[i * hqd..(i + 1) * hqd],
            );
            assert!(e < 2e-3, "session {} layer {layer}: rel err {e}", t.id);
            assert_eq!(t.gpu.tokens(layer).unwrap(), positions[i] + 1);
            assert!(
                t.gpu.cold_among(layer, &keep.union()).is_empty(),
                "every keep-set block is resident after the step"
            );
            assert_eq!(
                g.bytes_promoted,
                g.blocks_promoted as u64 * GEO.block_bytes() as u64
            );
        }
        if !gpu_res.cpu_fallback {
            let tiles: u64 = cpu_stats.iter().map(|s| s.tiles_selected as u64).sum();
            assert_eq!(gpu_res.cache_hits + gpu_res.cache_misses, tiles);
            assert_eq!(
                gpu_res.bytes_moved,
                gpu_res.cache_misses * GEO.tile_bytes() as u64
            );
        }
        results.push(gpu_res);
    }
    results
}

/// [`step_both_cold`] for all-resident sessions on the device path; returns the cache hits.
fn step_both(dec: &GpuDecoder, twins: &mut [Twin], rng: &mut Rng) -> u64 {
    step_both_cold(dec, twins, rng, None)
        .iter()
        .map(|r| {
            assert!(!r.cpu_fallback, "device path failed");
            r.cache_hits
        })
        .sum()
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn batch_1_many_steps_match_the_cpu() {
    let Some((ga, ca, dec)) = start(64) else {
        return;
    };
    println!("device: {}", dec.device_name());
    let mut rng = Rng::new(1);
    // 20 blocks + 9 tokens: 40 steps cross two block boundaries (top-k path throughout); the
    // sketch selector's session and the key bound's side by side.
    let mut twins = vec![
        twin(&dec, &ga, &ca, 7, 20 * 16 + 9, &mut rng),
        twin_with(&dec, (&ga, &ca), 8, 20 * 16 + 9, &mut rng, BOUND),
    ];
    let mut late_hits = 0;
    for s in 0..40 {
        let h = step_both(&dec, &mut twins, &mut rng);
        if s > 0 {
            late_hits += h;
        }
    }
    assert!(late_hits > 0, "later steps hit the GPU tile cache");
    dec.close(8).unwrap();
    dec.close(7).unwrap();
    assert!(matches!(dec.close(7), Err(GpuError::UnknownSession { .. })));
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn batch_8_mixed_lengths_match_the_cpu() {
    let Some((ga, ca, dec)) = start(128) else {
        return;
    };
    let mut rng = Rng::new(2);
    // Short (dense path), exactly at the budget, full tails, partial tails, long.
    let lens = [
        1,
        13 * 16,
        13 * 16 + 1,
        30 * 16 - 1,
        40 * 16,
        7,
        45 * 16 + 3,
        16,
    ];
    let mut twins: Vec<Twin> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| twin(&dec, &ga, &ca, 100 + i as u64, n, &mut rng))
        .collect();
    let mut late_hits = 0;
    for s in 0..20 {
        let h = step_both(&dec, &mut twins, &mut rng);
        if s > 0 {
            late_hits += h;
        }
    }
    assert!(late_hits > 0);
    // A sub-batch in another order, after the full batch: the bookkeeping is per session.
    let mut sub: Vec<Twin> = vec![twins.remove(6), twins.remove(1)];
    for _ in 0..5 {
        step_both(&dec, &mut sub, &mut rng);
    }
    // Invalidate forces a full re-upload and an empty tile cache; results stay identical.
    dec.invalidate(sub[0].id).unwrap();
    step_both(&dec, &mut sub, &mut rng);
}

/// Four lanes of two slots: sessions are spread over them; a step whose batch spans every lane
/// (one device call per lane, at once) and steps on each lane from its own thread, at the same
/// time, all match the CPU; a full decoder refuses one more session until one closes.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn lanes_spread_sessions_and_step_at_once_like_the_cpu() {
    if !gpu() {
        return;
    }
    let (ga, ca) = (arena(128), arena(128));
    let dec = GpuDecoder::new(
        &ga,
        &GpuSettings {
            lanes: 4,
            ..settings()
        },
    )
    .unwrap();
    assert_eq!(dec.lanes(), 4);
    let mut rng = Rng::new(21);
    let lens = [
        13 * 16 + 1,
        30 * 16 - 1,
        40 * 16,
        7,
        45 * 16 + 3,
        16,
        21 * 16,
        33 * 16 + 5,
    ];
    let mut twins: Vec<Twin> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| twin(&dec, &ga, &ca, 300 + i as u64, n, &mut rng))
        .collect();
    let lanes: Vec<usize> = twins.iter().map(|t| dec.lane_of(t.id).unwrap()).collect();
    assert_eq!(lanes, [0, 1, 2, 3, 0, 1, 2, 3], "least loaded lane first");
    // Full: every lane's two slots are taken.
    assert!(matches!(
        dec.open(399, &GEO, &POLICY),
        Err(GpuError::SessionsFull { .. })
    ));
    assert!(!dec.is_open(399));
    // One batch over all four lanes.
    for _ in 0..6 {
        step_both(&dec, &mut twins, &mut rng);
    }
    // Each lane's pair from its own thread, all at once.
    let mut pairs: Vec<Vec<Twin>> = (0..4).map(|_| Vec::new()).collect();
    for (t, l) in twins.into_iter().zip(lanes) {
        pairs[l].push(t);
    }
    let hits: u64 = std::thread::scope(|sc| {
        let handles: Vec<_> = pairs
            .iter_mut()
            .enumerate()
            .map(|(l, pair)| {
                let dec = &dec;
                sc.spawn(move || {
                    let mut rng = Rng::new(40 + l as u64);
                    (0..10).map(|_| step_both(dec, pair, &mut rng)).sum::<u64>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert!(hits > 0, "lanes keep their tile caches between steps");
    // A slot freed on lane 2 takes the next session.
    let gone = pairs[2].remove(0);
    dec.close(gone.id).unwrap();
    let back = twin(&dec, &ga, &ca, 400, 50, &mut rng);
    assert_eq!(dec.lane_of(back.id), Some(2));
    let mut all: Vec<Twin> = pairs.into_iter().flatten().chain([back]).collect();
    step_both(&dec, &mut all, &mut rng);
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn refusals_leave_sessions_unchanged() {
    let Some((ga, ca, dec)) = start(64) else {
        return;
    };
    let mut rng = Rng::new(3);

    // Geometry the kernels cannot run (head_dim not a power of two): refused, CPU path.
    let odd = Geometry {
        head_dim: 96,
        ..GEO
    };
    assert!(!dec.supports(&odd, &POLICY));
    assert!(matches!(
        dec.open(1, &odd, &POLICY),
        Err(GpuError::Unsupported { .. })
    ));
    let no_topk = Policy { top_k: 0, ..POLICY };
    assert!(!dec.supports(&GEO, &no_topk));
    assert!(dec.supports(&GEO, &POLICY));

    let mut t = twin(&dec, &ga, &ca, 5, 20 * 16, &mut rng);
    assert!(matches!(
        dec.open(5, &GEO, &POLICY),
        Err(GpuError::AlreadyOpen { .. })
    ));
    let hqd = (GEO.q_heads * GEO.head_dim) as usize;
    let q = rng.normals(hqd);
    let kv = GEO
        .dtype
        .encode_vec(&rng.normals(GEO.kv_heads as usize * GEO.head_dim as usize));
    let mut out = vec![0f32; hqd];
    let pos = t.gpu.tokens(0).unwrap();
    let mut run = |dec: &GpuDecoder, t: &mut Twin, session, position, q: &[f32], k: &[u8]| {
        let mut e = [DecodeEntry {
            session,
            layer: 0,
            kv: &mut t.gpu,
            policy: POLICY,
            position,
            q,
            k,
            v: &kv,
            cold: None,
        }];
        gpu_step(dec, 0, &mut e, &mut out, false)
    };
    let root = |r: Result<_, KernelError>| match r {
        Err(e) => format!("{:?}", e.root()),
        Ok(_) => panic!("accepted"),
    };
    let e = root(run(&dec, &mut t, 99, pos, &q, &kv));
    assert!(
        e.starts_with("Unavailable") && e.contains("not open on the GPU"),
        "{e}"
    );
    assert!(root(run(&dec, &mut t, 5, pos + 1, &q, &kv)).starts_with("Storage"));
    assert!(root(run(&dec, &mut t, 5, pos, &q[1..], &kv)).starts_with("QuerySize"));
    assert!(root(run(&dec, &mut t, 5, pos, &q, &kv[2..])).starts_with("Storage"));
    let mut qn = q.clone();
    qn[3] = f32::NAN;
    assert!(root(run(&dec, &mut t, 5, pos, &qn, &kv)).starts_with("NonFiniteQuery"));
    // A cold block the keep-set needs (the sink always is) with no colder tier to read it
    // from: refused before the append.
    assert!(t.gpu.evict(0, 0));
    let e = root(run(&dec, &mut t, 5, pos, &q, &kv));
    assert!(e.starts_with("Storage(NotResident { layer: 0"), "{e}");
    assert_eq!(t.gpu.tokens(0).unwrap(), pos, "nothing appended on refusal");
    // Capacity: a session longer than max_blocks is refused.
    let mut long = twin(&dec, &ga, &ca, 6, 64 * 16, &mut rng);
    let e = root(run(&dec, &mut long, 6, 64 * 16, &q, &kv));
    assert!(
        e.starts_with("Unavailable") && e.contains("max_blocks"),
        "{e}"
    );
    assert_eq!(long.gpu.tokens(0).unwrap(), 64 * 16);
    assert!(matches!(
        gpu_step(&dec, 0, &mut [], &mut out, false),
        Err(KernelError::EmptyBatch)
    ));
    // Duplicate session in one batch.
    let mut a = twin(&dec, &ga, &ca, 8, 40, &mut rng);
    let mut b = KvCache::new(GEO, ga.clone()).unwrap();
    b.append(0, 40, &random_kv(&mut rng, 40)).unwrap();
    let mut out2 = vec![0f32; 2 * hqd];
    let mut dup = [
        DecodeEntry {
            session: 8,
            layer: 0,
            kv: &mut a.gpu,
            policy: POLICY,
            position: 40,
            q: &q,
            k: &kv,
            v: &kv,
            cold: None,
        },
        DecodeEntry {
            session: 8,
            layer: 0,
            kv: &mut b,
            policy: POLICY,
            position: 40,
            q: &q,
            k: &kv,
            v: &kv,
            cold: None,
        },
    ];
    let e = gpu_step(&dec, 0, &mut dup, &mut out2, false).unwrap_err();
    assert!(
        matches!(&e, KernelError::Unavailable { reason } if reason.contains("appears twice")),
        "{e}"
    );
    assert!(matches!(
        gpu_step(&dec, 0, &mut dup[..1], &mut out2, false),
        Err(KernelError::OutputSize { .. })
    ));
    assert_eq!(a.gpu.tokens(0).unwrap(), 40);
    // Backend cap: a second (geometry, policy) fills max_backends = 2, a third is refused.
    let other = Policy { top_k: 4, ..POLICY };
    dec.open(20, &GEO, &other).unwrap();
    let third = Policy { top_k: 5, ..POLICY };
    assert!(!dec.supports(&GEO, &third));
    assert!(matches!(
        dec.open(21, &GEO, &third),
        Err(GpuError::Unsupported { .. })
    ));
}

/// An NVMe tier on a real page file (io_uring, or pread where io_uring is unavailable) in `dir`.
fn nvme_tier(dir: &Path) -> NvmeTier {
    let store = PageStore::open(
        &PageStoreConfig {
            devices: vec![DeviceConfig {
                path: dir.join("pages-0"),
                capacity_bytes: 256 << 20,
                bandwidth_bytes_per_s: 1.0,
            }],
            max_payload: GEO.block_bytes(),
        },
        open_best_driver(UringConfig::default()),
    )
    .unwrap();
    NvmeTier::open(store, dir).unwrap().0
}

/// What the daemon's DEMOTE does: writes every resident block of the GPU copy to the tier
/// (cold blocks keep their pages), then frees every frame. Returns the blocks made cold.
fn demote(tier: &NvmeTier, t: &mut Twin) -> usize {
    let mut runs = Vec::new();
    for l in 0..GEO.layers {
        for b in 0..t.gpu.layer(l).unwrap().blocks() as u32 {
            if let Some(bytes) = t.gpu.run(l, b) {
                runs.push(BlockRun {
                    layer: l,
                    block: b,
                    bytes,
                });
            }
        }
    }
    let record = SessionRecord {
        id: t.id,
        owner_uid: 0,
        label: "gpu-cold".into(),
        pinned: false,
        geometry: (&GEO).into(),
        policy: (&POLICY).into(),
        layer_tokens: (0..GEO.layers).map(|l| t.gpu.tokens(l).unwrap()).collect(),
        pages: Vec::new(),
        created_unix_ms: 0,
    };
    tier.put_session(&record, &runs).unwrap();
    let mut cold = 0;
    for l in 0..GEO.layers {
        for b in 0..t.gpu.layer(l).unwrap().blocks() as u32 {
            cold += t.gpu.evict(l, b) as usize;
        }
    }
    cold
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn sessions_on_nvme_decode_on_the_gpu_like_the_cpu_over_ram() {
    let Some((_dir, tier, ga, ca, dec)) = start_with_tier(128) else {
        return;
    };
    let mut rng = Rng::new(4);
    // Partial tail (promoted before the first append), full tail, a long one, and a session
    // that stays in RAM in the same batches; 5 entries = two device calls at max_batch 4.
    let lens = [30 * 16 + 9, 45 * 16, 60 * 16 + 1, 25 * 16 + 3, 40 * 16 + 2];
    let mut twins: Vec<Twin> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| twin(&dec, &ga, &ca, 300 + i as u64, n, &mut rng))
        .collect();
    // Warm the device state and tile caches first, so demotion leaves mappings and cached
    // tiles of blocks that are now cold.
    for _ in 0..3 {
        step_both(&dec, &mut twins, &mut rng);
    }
    let round = |dec: &GpuDecoder, twins: &mut [Twin], rng: &mut Rng| {
        for t in twins.iter_mut().take(4) {
            // Blocks a previous round left cold keep their pages; the rest go now.
            let resident = t.gpu.extents();
            assert_eq!(demote(&tier, t), resident, "every resident block demoted");
            assert_eq!(t.gpu.extents(), 0, "every block cold");
        }
        let (mut promoted, mut hits, mut cold_steps) = (0u64, 0u64, 0);
        for _ in 0..6 {
            // Random queries spread the top-k widely, so later steps may find every block
            // promoted; the first ones run with most of each layer on NVMe.
            if twins[..4].iter().all(|t| t.gpu.extents() < t.gpu.blocks()) {
                cold_steps += 1;
            }
            for r in step_both_cold(dec, twins, rng, Some(&tier)) {
                assert!(!r.cpu_fallback, "the device answered");
                assert_eq!(r.cold_divergences, 0);
                promoted += r
                    .entries
                    .iter()
                    .map(|e| e.blocks_promoted as u64)
                    .sum::<u64>();
                hits += r.cache_hits;
                assert_eq!(
                    r.entries[4].blocks_promoted, 0,
                    "the all-RAM session reads nothing"
                );
            }
        }
        assert!(cold_steps >= 2, "steps with cold blocks: {cold_steps}");
        assert!(promoted > 0 && hits > 0, "promoted {promoted}, hits {hits}");
        eprintln!("round: {promoted} blocks promoted, {hits} GPU tile-cache hits");
    };
    round(&dec, &mut twins, &mut rng);
    // Again, after the appended tokens made the tails and new blocks resident.
    round(&dec, &mut twins, &mut rng);
}

#[test]
// The fault hook exists in debug builds and builds with the test-faults feature.
#[cfg(any(debug_assertions, feature = "test-faults"))]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn a_device_selection_of_a_cold_block_is_answered_on_the_cpu() {
    let Some((_dir, tier, ga, ca, dec)) = start_with_tier(64) else {
        return;
    };
    let mut rng = Rng::new(5);
    let mut twins = vec![
        twin(&dec, &ga, &ca, 40, 35 * 16 + 5, &mut rng),
        twin(&dec, &ga, &ca, 41, 20 * 16, &mut rng),
    ];
    step_both(&dec, &mut twins, &mut rng);
    demote(&tier, &mut twins[0]);
    // The device is handed a layer whose keep-set still has cold blocks (mapped to the zero
    // frame): the check must catch it, the CPU answer the call and read those blocks.
    dec.fault_leave_cold(2);
    let r = step_both_cold(&dec, &mut twins, &mut rng, Some(&tier));
    assert!(r[0].cpu_fallback, "layer 0 answered on the CPU");
    assert_eq!(r[0].cold_divergences, 1, "only the cold session diverged");
    assert!(!r[1].cpu_fallback, "the fault covers one step only");
    // The diverging session's device state was dropped (its tile cache may hold zero tiles):
    // later steps are exact on the device again.
    for _ in 0..6 {
        for r in step_both_cold(&dec, &mut twins, &mut rng, Some(&tier)) {
            assert!(!r.cpu_fallback);
            assert_eq!(r.cold_divergences, 0);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn a_failed_nvme_read_refuses_the_step_and_changes_nothing() {
    let Some((_dir, tier, ga, ca, dec)) = start_with_tier(64) else {
        return;
    };
    let mut rng = Rng::new(6);
    let mut t = twin(&dec, &ga, &ca, 50, 30 * 16 + 4, &mut rng);
    demote(&tier, &mut t);
    let hqd = (GEO.q_heads * GEO.head_dim) as usize;
    let q = rng.normals(hqd);
    let kv = GEO
        .dtype
        .encode_vec(&rng.normals(GEO.kv_heads as usize * GEO.head_dim as usize));
    let mut out = vec![0f32; hqd];
    let pos = t.gpu.tokens(0).unwrap();
    let mut attempt = |t: &mut Twin, cold: Option<&dyn ColdSource>| {
        gpu_step(
            &dec,
            0,
            &mut [DecodeEntry {
                session: 50,
                layer: 0,
                kv: &mut t.gpu,
                policy: POLICY,
                position: pos,
                q: &q,
                k: &kv,
                v: &kv,
                cold,
            }],
            &mut out,
            false,
        )
        .map(|_| ())
    };
    // No colder tier: the cold tail is refused by name.
    let e = attempt(&mut t, None).unwrap_err();
    let tail = t.gpu.layer(0).unwrap().blocks() as u32 - 1;
    assert!(
        matches!(
            e.root(),
            KernelError::Storage(StorageError::NotResident {
                layer: 0,
                blocks: 1
            })
        ),
        "{e}"
    );
    assert!(t.gpu.cold_among(0, &[tail]) == vec![tail]);
    // Pages of another session id: the read fails, typed, and nothing changed.
    let wrong = TierSource {
        tier: &tier,
        session: 999,
    };
    let e = attempt(&mut t, Some(&wrong)).unwrap_err();
    assert!(matches!(e, KernelError::Entry { entry: 0, .. }), "{e}");
    assert!(
        matches!(
            e.root(),
            KernelError::Storage(StorageError::ColdRead { layer: 0, .. })
        ),
        "{e}"
    );
    assert_eq!(t.gpu.tokens(0).unwrap(), pos);
    assert_eq!(t.gpu.extents(), 0, "nothing read, nothing appended");
    // The right pages: the step goes through and matches the CPU from here on.
    for _ in 0..3 {
        for r in step_both_cold(&dec, std::slice::from_mut(&mut t), &mut rng, Some(&tier)) {
            assert!(!r.cpu_fallback);
        }
    }
}
