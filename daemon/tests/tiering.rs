//! The NVMe tier through a real tierd: demotion and promotion, keep-sets spanning RAM and NVMe,
//! warm restart after SIGTERM and kill -9, corruption, full tiers, memory pressure.

mod common;

use std::io::{Seek, SeekFrom, Write};
use std::time::Duration;

use common::*;
use kvtier_protocol::client::Client;
use kvtier_protocol::ErrorCode;

/// Two sessions holding identical KV (same shadow seed).
fn twins(c: &mut Client, n: u32, seed: u64) -> ((u64, Shadow), (u64, Shadow)) {
    (open(c, "twin", n, seed), open(c, "twin", n, seed))
}

/// Decodes the same step (same q, k, v) on both twins, every layer; returns the stats of `a`.
fn step_both(
    c: &mut Client,
    a: &mut (u64, Shadow),
    b: &mut (u64, Shadow),
) -> Vec<kvtier_protocol::DecodeStats> {
    let mut stats = Vec::new();
    for layer in 0..a.1.g.layers as usize {
        let pos = a.1.tokens(layer);
        let (q, k, v) = a.1.step_input(layer);
        let (qb, kb, vb) = b.1.step_input(layer);
        assert_eq!((&q, &k, &v), (&qb, &kb, &vb), "twins draw the same inputs");
        let qbytes = f32_bytes(&q);
        let oa = c
            .decode(layer as u32, entry(a.0, pos, &qbytes, &k, &v), true)
            .unwrap();
        let ob = c
            .decode(layer as u32, entry(b.0, pos, &qbytes, &k, &v), true)
            .unwrap();
        a.1.check(layer, &q, &oa);
        assert_eq!(
            oa.out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            ob.out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "a session served from NVMe answers bit-identically to its all-RAM twin"
        );
        assert_eq!(
            oa.stats.as_ref().unwrap().selected,
            ob.stats.as_ref().unwrap().selected
        );
        stats.push(oa.stats.unwrap());
    }
    stats
}

#[test]
fn keep_sets_spanning_ram_and_nvme_equal_all_ram() {
    // On-demand promotion alone (the read-ahead has its own test below).
    let d = Daemon::with(&["nvme.prefetch_blocks=0"]);
    let mut c = d.client();
    let (mut a, mut b) = twins(&mut c, 600, 42);
    let blocks = 2 * 38; // 600 tokens = 38 blocks of 16, two layers
    assert_eq!(c.demote(a.0).unwrap(), blocks);
    let info = c.session_info(a.0).unwrap();
    assert_eq!(info.host_bytes, 0, "demoted: no host extents");
    assert!(info.nvme_bytes >= blocks * 4096, "{info:?}");
    let (mut from_nvme, mut mixed) = (0, 0);
    for step in 0..12 {
        for s in step_both(&mut c, &mut a, &mut b) {
            if s.blocks_nvme > 0 {
                from_nvme += 1;
                if s.blocks_ram > 0 {
                    mixed += 1;
                }
            }
        }
        if step == 5 {
            // Cold again: everything written back (the decoded tokens too), extents freed.
            assert!(c.demote(a.0).unwrap() > 0);
        }
    }
    assert!(from_nvme >= 2, "NVMe-served steps: {from_nvme}");
    assert!(
        mixed >= 1,
        "steps whose keep-set spanned RAM and NVMe: {mixed}"
    );
    // PROMOTE brings the rest back; SESSION_INFO agrees with the twin.
    assert!(c.promote(a.0).unwrap() > 0);
    let (ia, ib) = (c.session_info(a.0).unwrap(), c.session_info(b.0).unwrap());
    assert_eq!(
        (ia.tokens_max, ia.blocks, ia.host_bytes),
        (ib.tokens_max, ib.blocks, ib.host_bytes)
    );
    let stats = c.stats().unwrap();
    assert!(stats.get("blocks_promoted_total").unwrap() >= blocks);
    assert_eq!(stats.get("demotions_total"), Some(2));
}

#[test]
fn pinned_sessions_are_not_demoted_and_an_append_to_a_demoted_session_works() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let (mut a, mut b) = twins(&mut c, 40, 7); // 40 tokens: a partial tail block
    c.pin(a.0, true).unwrap();
    assert!(c.session_info(a.0).unwrap().pinned);
    let e = c.demote(a.0).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::FailedPrecondition));
    c.pin(a.0, false).unwrap();
    c.demote(a.0).unwrap();
    // The cold partial tail comes back for the append.
    let p = a.1.payload(30);
    assert_eq!(c.append_kv(a.0, 40, 30, &p).unwrap(), 70);
    let p = b.1.payload(30);
    c.append_kv(b.0, 40, 30, &p).unwrap();
    step_both(&mut c, &mut a, &mut b);
}

#[test]
fn sessions_survive_a_clean_restart_and_decode_bit_identically() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let g = small_geometry();
    let (mut a, mut b) = twins(&mut c, 333, 99);
    step_both(&mut c, &mut a, &mut b);
    // Before the restart: one more step on b only, remembering its inputs and outputs.
    let mut before = Vec::new();
    for layer in 0..2usize {
        let pos = b.1.tokens(layer);
        let (q, k, v) = b.1.step_input(layer);
        let qb = f32_bytes(&q);
        let out = c
            .decode(layer as u32, entry(b.0, pos, &qb, &k, &v), true)
            .unwrap();
        before.push((pos, qb, k, v, out));
    }
    c.close(b.0).unwrap();
    let created = c.session_info(a.0).unwrap().created_unix_ms;
    drop(c);
    let dir = d.stop(false);
    // The restart comes well after the creation, so a reset time would show.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let d = Daemon::start_in(dir, &[]);
    let mut c = d.client();
    let list = c.list_sessions().unwrap();
    assert_eq!(list.len(), 1, "the closed twin is gone, the other restored");
    assert_eq!((list[0].session, list[0].tokens_max), (a.0, 334));
    assert_eq!(
        list[0].created_unix_ms, created,
        "the creation time survives"
    );
    for (layer, (pos, qb, k, v, out)) in before.iter().enumerate() {
        let again = c
            .decode(layer as u32, entry(a.0, *pos, qb, k, v), true)
            .unwrap();
        assert_eq!(
            again.out, out.out,
            "layer {layer}: same answer as before the restart"
        );
        assert_eq!(
            again.stats.unwrap().selected,
            out.stats.as_ref().unwrap().selected
        );
    }
    // New sessions get fresh ids (random: never one restored).
    let fresh = c.create_session(g, policy(), "").unwrap();
    assert!(fresh != a.0 && fresh != b.0);
}

#[test]
fn a_corrupted_page_is_data_loss_never_data_and_others_keep_serving() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let (victim, mut vs) = open(&mut c, "victim", 200, 5);
    c.demote(victim).unwrap();
    // Overwrite the first pages of the (only) page file: the victim's.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.page_file())
        .unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(&vec![0xA5; 8 * 8192]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let (other, mut os) = open(&mut c, "bystander", 100, 6);
    assert_eq!(
        c.promote(victim).unwrap_err().code(),
        Some(ErrorCode::DataLoss)
    );
    let (q, k, v) = vs.step_input(0);
    let qb = f32_bytes(&q);
    let e = c
        .decode(0, entry(victim, 200, &qb, &k, &v), true)
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::DataLoss), "{e}");
    assert!(
        c.stats()
            .unwrap()
            .get("nvme_checksum_errors_total")
            .unwrap()
            > 0
    );
    // The bystander is untouched.
    os.decode(&mut c, other, 0);
    c.close(victim).unwrap();
}

#[test]
fn a_full_nvme_tier_is_resource_exhausted_and_the_session_stays_in_ram() {
    // 12 pages of 8 KiB: room for fewer blocks than the session has.
    let d = Daemon::with(&["nvme.capacity=\"96KiB\""]);
    let mut c = d.client();
    let (mut a, mut b) = twins(&mut c, 200, 3);
    let e = c.demote(a.0).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    assert!(c.session_info(a.0).unwrap().host_bytes > 0, "still in RAM");
    step_both(&mut c, &mut a, &mut b);
}

#[test]
fn memory_pressure_demotes_idle_sessions_and_everything_still_decodes() {
    // 96 extents of 4 KiB; each session below holds 2 x 20 = 40 blocks.
    let d = Daemon::with(&["host.capacity=\"384KiB\""]);
    let mut c = d.client();
    let mut sessions: Vec<(u64, Shadow)> = (0..4).map(|i| open(&mut c, "", 320, 100 + i)).collect();
    let stats = c.stats().unwrap();
    assert!(stats.get("demotions_total").unwrap() >= 2, "{stats:?}");
    assert!(stats.get("host_extents_used").unwrap() <= 96);
    for (id, sh) in &mut sessions {
        sh.step(&mut c, *id);
    }
}

/// Write-through ingestion killed at random moments, 200 times: every acknowledged token
/// survives and decodes correctly; an unacknowledged append is either wholly there or absent.
#[test]
fn crash_loop_write_through_loses_nothing_acknowledged() {
    let cycles: usize = std::env::var("KVTIER_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let args = ["--set", "nvme.write_through=true"];
    let g = small_geometry();
    let mut d = Daemon::start(&args);
    let id = d.client().create_session(g, policy(), "crash").unwrap();
    let mut sh = Shadow::new(g, 2024);
    let mut acked = 0u64;
    let mut rng = kvtier_storage::testing::Rng::new(1);
    let (mut lost_inflight, mut landed_inflight) = (0, 0);
    for cycle in 0..cycles {
        // Ingest in 8-token chunks until the daemon dies under us.
        let killer = {
            let pid = d.pid();
            let delay = Duration::from_micros(500 + rng.below(15_000));
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                // SAFETY: kill has no memory-safety preconditions; pid is the test's child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            })
        };
        // The killer may strike before we even connect: then nothing is in flight.
        let mut pending = None;
        if let Ok(mut c) = Client::connect(d.path()) {
            loop {
                let mut trial = sh.clone();
                let p = trial.payload(8);
                match c.append_kv(id, acked, 8, &p) {
                    Ok(t) => {
                        assert_eq!(t, acked + 8);
                        acked += 8;
                        sh = trial;
                    }
                    Err(_) => {
                        pending = Some(trial);
                        break;
                    }
                }
            }
        }
        killer.join().unwrap();
        let dir = d.stop(true);
        d = Daemon::start_in(dir, &args);
        let mut c = d.client();
        let info = c
            .session_info(id)
            .unwrap_or_else(|e| panic!("cycle {cycle}: session lost: {e}"));
        if info.tokens_max == acked + 8 {
            // The append committed but its reply was lost: it must be exactly that append.
            sh = pending.expect("only an append in flight can land unacknowledged");
            acked += 8;
            landed_inflight += 1;
        } else {
            lost_inflight += 1;
        }
        assert_eq!(
            (info.tokens_min, info.tokens_max),
            (acked, acked),
            "cycle {cycle}"
        );
        if cycle % 20 == 19 || cycle + 1 == cycles {
            // Full check of the data: one decode step per layer against the oracle, made
            // durable again with DEMOTE so later cycles keep an exact shadow.
            sh.step(&mut c, id);
            acked += 1;
            c.demote(id).unwrap();
        }
    }
    eprintln!("{cycles} kill -9 cycles: {acked} tokens acknowledged; in-flight appends landed {landed_inflight}, absent {lost_inflight}");
}

/// After a step that read cold blocks, the runners-up just below the cut are read back in the
/// background: a later step whose ranking shifts finds them resident.
#[test]
fn blocks_ranked_just_below_the_cut_are_promoted_ahead_of_need() {
    let d = Daemon::with(&["nvme.prefetch_blocks=3"]);
    let mut c = d.client();
    let (mut a, mut b) = twins(&mut c, 800, 77); // 50 blocks per layer
    c.demote(a.0).unwrap();
    let stats = step_both(&mut c, &mut a, &mut b);
    let keep_extents: u64 = stats
        .iter()
        .map(|s| {
            let mut u: Vec<u32> = s.selected.iter().flatten().copied().collect();
            u.sort_unstable();
            u.dedup();
            u.len() as u64
        })
        .sum();
    let mut prefetched = 0;
    for _ in 0..200 {
        prefetched = c.stats().unwrap().get("blocks_prefetched_total").unwrap();
        if prefetched > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(prefetched > 0, "no runner-up was read ahead");
    std::thread::sleep(Duration::from_millis(100));
    let resident = c.session_info(a.0).unwrap().host_bytes / 4096;
    assert!(
        resident > keep_extents,
        "{resident} extents resident vs {keep_extents} in the keep-sets"
    );
    // Later steps still answer exactly like the all-RAM twin.
    for _ in 0..3 {
        step_both(&mut c, &mut a, &mut b);
    }
}

/// A session of 320 tokens: 2 layers x 20 blocks of 4 KiB.
fn session_320(c: &mut Client, label: &str, seed: u64) -> (u64, Shadow) {
    open(c, label, 320, seed)
}

#[test]
fn pins_survive_a_clean_restart_and_kill_9_and_keep_the_session_in_ram_under_pressure() {
    // 96 extents of 4 KiB: a pinned 40-extent session and pressure from new sessions.
    let args = [
        "--set",
        "host.capacity=\"384KiB\"",
        "--set",
        "nvme.prefetch_blocks=0",
    ];
    for kill9 in [false, true] {
        let d = Daemon::start(&args);
        let mut c = d.client();
        let (pinned, mut psh) = session_320(&mut c, "pinned", 1);
        let (other, _) = session_320(&mut c, "unpinned again", 2);
        if kill9 {
            // Durable copies first: a kill -9 keeps only what is on NVMe, so these PINs are
            // committed to the manifest when they are answered.
            for id in [pinned, other] {
                c.demote(id).unwrap();
                c.promote(id).unwrap();
            }
        }
        // (Without kill -9 the sessions are not on NVMe yet: the clean shutdown writes them,
        // flags included.)
        c.pin(pinned, true).unwrap();
        c.pin(other, true).unwrap();
        c.pin(other, false).unwrap();
        drop(c);
        let dir = d.stop(kill9);
        let d = Daemon::start_in(dir, &args);
        let mut c = d.client();
        let list = c.list_sessions().unwrap();
        let flag = |id| list.iter().find(|s| s.session == id).unwrap().pinned;
        assert!(flag(pinned), "kill9={kill9}: the pin survived");
        assert!(!flag(other), "kill9={kill9}: the unpin survived");
        assert!(c.session_info(pinned).unwrap().pinned);
        let full = 40 * 4096;
        assert_eq!(c.session_info(pinned).unwrap().host_bytes, full);
        assert_eq!(
            c.demote(pinned).unwrap_err().code(),
            Some(ErrorCode::FailedPrecondition)
        );
        // Memory pressure: three more 40-extent sessions do not fit beside the two restored.
        // The pinned session is the least recently used, so it would go first if the pin
        // had been lost.
        for i in 0..3 {
            session_320(&mut c, "pressure", 10 + i);
        }
        let stats = c.stats().unwrap();
        assert!(
            stats.get("demotions_total").unwrap() >= 2,
            "kill9={kill9}: {stats:?}"
        );
        let info = c.session_info(pinned).unwrap();
        assert!(info.pinned);
        assert_eq!(info.host_bytes, full, "kill9={kill9}: never demoted");
        assert!(
            c.session_info(other).unwrap().host_bytes < full,
            "the unpinned one was"
        );
        psh.step(&mut c, pinned);
    }
}

#[test]
fn a_warm_restart_keeps_blocks_resident_exactly_up_to_low_water() {
    // 96 extents of 4 KiB, low water 0.75: 72 extents. Two 40-extent sessions restore in
    // batches, yet exactly as block by block: the first restored (ids decide the order, and
    // ids are random) all resident, the second until the host tier reaches 72 extents, the
    // rest cold. The CPU backend: on a GPU host the CUDA
    // decoder keeps one arena extent as its zero extent, which shifts the count by one.
    let args = [
        "--backend",
        "cpu",
        "--set",
        "host.capacity=\"384KiB\"",
        "--set",
        "nvme.prefetch_blocks=0",
        "--set",
        "nvme.workers=2",
    ];
    let d = Daemon::start(&args);
    let mut c = d.client();
    let (a, ash) = session_320(&mut c, "first", 1);
    let (b, bsh) = session_320(&mut c, "second", 2);
    let ((first, _), (second, mut sh)) = if a < b {
        ((a, ash), (b, bsh))
    } else {
        ((b, bsh), (a, ash))
    };
    drop(c);
    let d = Daemon::start_in(d.stop(false), &args);
    let mut c = d.client();
    assert_eq!(c.stats().unwrap().get("host_extents_used"), Some(72));
    assert_eq!(c.session_info(first).unwrap().host_bytes, 40 * 4096);
    assert_eq!(c.session_info(second).unwrap().host_bytes, 32 * 4096);
    // The cold blocks come back when a keep-set needs them.
    sh.step(&mut c, second);
}

/// Per-device link estimates in STATS, from a daemon striping over two page files.
fn link_stat(c: &mut Client, dev: usize, what: &str) -> u64 {
    let key = format!("nvme_dev{dev}_{what}");
    c.stats()
        .unwrap()
        .get(&key)
        .unwrap_or_else(|| panic!("STATS lacks {key}"))
}

#[test]
fn a_restore_tracks_each_devices_read_rate_and_stats_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let devices = format!(
        "nvme.devices=[{{path={:?},capacity=\"32MiB\"}},{{path={:?},capacity=\"32MiB\"}}]",
        dir.path().join("dev-a").to_str().unwrap(),
        dir.path().join("dev-b").to_str().unwrap()
    );
    let args = ["--set", devices.as_str(), "--set", "nvme.prefetch_blocks=0"];
    let d = Daemon::start_in(dir, &args);
    let mut c = d.client();
    for dev in 0..2 {
        for what in [
            "read_bytes_per_s",
            "read_latency_ns",
            "write_bytes_per_s",
            "write_latency_ns",
        ] {
            assert_eq!(link_stat(&mut c, dev, what), 0, "nothing measured yet");
        }
    }
    let (a, _) = session_320(&mut c, "a", 3);
    let (b, _) = session_320(&mut c, "b", 4);
    c.demote(a).unwrap();
    for dev in 0..2 {
        assert!(link_stat(&mut c, dev, "write_bytes_per_s") > 0, "dev {dev}");
        assert_eq!(link_stat(&mut c, dev, "read_bytes_per_s"), 0);
    }
    c.close(b).unwrap();
    drop(c);
    // The warm restart reads session a back from both devices.
    let dir = d.stop(false);
    let d = Daemon::start_in(dir, &args);
    let mut c = d.client();
    assert_eq!(c.session_info(a).unwrap().tokens_max, 320);
    let stats = c.stats().unwrap();
    assert_eq!(stats.get("nvme_devices"), Some(2));
    for dev in 0..2 {
        let bw = link_stat(&mut c, dev, "read_bytes_per_s");
        // Finite and plausible for a disk, page cache or tmpfs: 1 MB/s .. 1 TB/s.
        assert!(
            (1_000_000..1_000_000_000_000).contains(&bw),
            "dev {dev}: {bw} B/s"
        );
        assert!(link_stat(&mut c, dev, "read_latency_ns") < 1_000_000_000);
        // A fresh process has written nothing yet.
        assert_eq!(link_stat(&mut c, dev, "write_bytes_per_s"), 0);
    }
}
