//! The Prometheus endpoint of a real tierd during a decode run: every metric is present, and
//! its values agree with STATS (bracketed while the run is going, equal once it stops).

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use kvtier_protocol::{stats_keys, ErrorCode, StatsReply};
use tierd::metrics::names;
use tierd::service::extra_stats_keys as x;

/// The harness daemon serving metrics on a free local port, plus `extra`; and the port.
fn with_metrics(extra: &[&str]) -> (Tierd, u16) {
    let port = free_port();
    let listen = format!("metrics.listen=\"127.0.0.1:{port}\"");
    (harness().set(&listen).args(extra).start(), port)
}

fn get(m: &BTreeMap<String, f64>, series: &str) -> f64 {
    *m.get(series)
        .unwrap_or_else(|| panic!("{series} missing from the scrape: {:#?}", m.keys()))
}

fn sum(m: &BTreeMap<String, f64>, name: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

fn stat(s: &StatsReply, key: &str) -> f64 {
    s.get(key).unwrap_or_else(|| panic!("STATS lacks {key}")) as f64
}

/// Scrape-time series and the STATS key each one mirrors.
const MIRRORED: [(&str, &str); 9] = [
    (names::SESSIONS, stats_keys::SESSIONS),
    (
        "kvtier_tier_used_bytes{tier=\"host\"}",
        stats_keys::HOST_BYTES_USED,
    ),
    (
        "kvtier_tier_capacity_bytes{tier=\"host\"}",
        stats_keys::HOST_BYTES_CAPACITY,
    ),
    (
        "kvtier_tier_used_blocks{tier=\"host\"}",
        stats_keys::HOST_EXTENTS_USED,
    ),
    (names::DECODE_REQUESTS, stats_keys::DECODE_REQUESTS_TOTAL),
    (names::DECODE_ENTRIES, stats_keys::DECODE_ENTRIES_TOTAL),
    (names::APPEND_TOKENS, stats_keys::APPEND_TOKENS_TOTAL),
    (names::DECODE_TOUCHED_BYTES, stats_keys::BYTES_TOUCHED_TOTAL),
    (names::DECODE_SELECTED_TILES, x::SELECTED_TILES_TOTAL),
];

#[test]
fn a_scrape_during_a_decode_run_shows_every_metric_matching_stats() {
    let (d, port) = with_metrics(&["--set", "admission.max_sessions=3"]);
    let g = small_geometry();

    // Some failures and one admission rejection, so those series carry real counts.
    let mut c = d.client();
    assert_eq!(
        c.session_info(999).unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );
    let ids: Vec<u64> = (0..3)
        .map(|i| c.create_session(g, policy(), &format!("s{i}")).unwrap())
        .collect();
    let e = c.create_session(g, policy(), "one too many").unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted));

    // The decode run: three sessions stepping every layer on their own connections.
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let (sock, stop) = (d.path().to_path_buf(), stop.clone());
            std::thread::spawn(move || {
                let mut c = kvtier_protocol::client::Client::connect(&sock).unwrap();
                let mut sh = Shadow::new(g, 100 + i as u64);
                let p = sh.payload(300);
                c.append_kv(id, 0, 300, &p).unwrap();
                let mut steps = 0;
                while !stop.load(Ordering::Relaxed) || steps < 20 {
                    sh.step(&mut c, id);
                    steps += 1;
                }
            })
        })
        .collect();

    // Mid-run: every metric is there, and each counter lies between STATS read just before
    // and just after the scrape.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before = c.stats().unwrap();
    let m = scrape(port);
    let after = c.stats().unwrap();
    for (series, key) in MIRRORED {
        let v = get(&m, series);
        assert!(
            stat(&before, key) <= v && v <= stat(&after, key),
            "{series} = {v} outside STATS {key} [{}, {}]",
            stat(&before, key),
            stat(&after, key)
        );
    }
    assert!(get(&m, names::DECODE_REQUESTS) > 0.0, "the run is decoding");
    assert_eq!(get(&m, names::READY), 1.0);
    for stage in ["append", "select", "attend"] {
        assert!(
            get(
                &m,
                &format!("kvtier_decode_stage_seconds_count{{stage=\"{stage}\"}}")
            ) > 0.0
        );
    }
    for series in [
        "kvtier_decode_seconds_count",
        "kvtier_decode_keep_set_blocks_count",
        "kvtier_decode_keep_set_blocks_bucket{le=\"4\"}",
        "kvtier_errors_total{code=\"DATA_LOSS\"}",
        "kvtier_admission_rejections_total{reason=\"queue_full\"}",
    ] {
        get(&m, series);
    }

    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }

    // At rest: equal to STATS, series by series.
    let s = c.stats().unwrap();
    let m = scrape(port);
    for (series, key) in MIRRORED {
        assert_eq!(get(&m, series), stat(&s, key), "{series} vs STATS {key}");
    }
    let uptime = get(&m, names::UPTIME);
    assert!(
        (uptime - stat(&s, stats_keys::UPTIME_MS) / 1e3).abs() < 1.0,
        "uptime {uptime}"
    );
    assert_eq!(sum(&m, names::ERRORS), stat(&s, stats_keys::ERRORS_TOTAL));
    assert_eq!(get(&m, "kvtier_errors_total{code=\"NOT_FOUND\"}"), 1.0);
    assert_eq!(
        get(&m, "kvtier_errors_total{code=\"RESOURCE_EXHAUSTED\"}"),
        1.0
    );
    assert_eq!(
        sum(&m, names::ADMISSION_REJECTIONS),
        stat(&s, stats_keys::REJECTED_TOTAL)
    );
    assert_eq!(
        get(
            &m,
            "kvtier_admission_rejections_total{reason=\"max_sessions\"}"
        ),
        1.0
    );
    let requests = stat(&s, stats_keys::DECODE_REQUESTS_TOTAL);
    for (stage, key) in [
        ("append", x::DECODE_APPEND_NS_TOTAL),
        ("select", x::DECODE_SELECT_NS_TOTAL),
        ("attend", x::DECODE_ATTEND_NS_TOTAL),
    ] {
        let count = get(
            &m,
            &format!("kvtier_decode_stage_seconds_count{{stage=\"{stage}\"}}"),
        );
        assert_eq!(count, requests, "one {stage} observation per DECODE");
        let secs = get(
            &m,
            &format!("kvtier_decode_stage_seconds_sum{{stage=\"{stage}\"}}"),
        );
        let want = stat(&s, key) / 1e9;
        assert!(
            (secs - want).abs() <= 1e-6 * want.max(1e-3),
            "{stage}: {secs} s vs STATS {want} s"
        );
        assert!(secs > 0.0);
    }
    assert_eq!(get(&m, "kvtier_decode_seconds_count"), requests);
    // Every entry's keep-set: 1 sink + 1 local + 2 top-k blocks once past 4 blocks.
    let entries = stat(&s, stats_keys::DECODE_ENTRIES_TOTAL);
    assert_eq!(get(&m, "kvtier_decode_keep_set_blocks_count"), entries);
    assert_eq!(get(&m, "kvtier_decode_keep_set_blocks_sum"), 4.0 * entries);
    assert_eq!(
        get(&m, "kvtier_decode_keep_set_blocks_bucket{le=\"2\"}"),
        0.0
    );
    assert_eq!(
        get(&m, "kvtier_decode_keep_set_blocks_bucket{le=\"4\"}"),
        entries
    );

    // The harness enables the NVMe tier: its series mirror STATS' nvme_* keys.
    for (series, key) in [
        ("kvtier_tier_used_bytes{tier=\"nvme\"}", "nvme_bytes_used"),
        (
            "kvtier_tier_capacity_bytes{tier=\"nvme\"}",
            "nvme_bytes_capacity",
        ),
        (
            "kvtier_link_moved_bytes_total{link=\"nvme_to_host\"}",
            "nvme_read_bytes_total",
        ),
        (
            "kvtier_link_moved_bytes_total{link=\"host_to_nvme\"}",
            "nvme_written_bytes_total",
        ),
        (
            "kvtier_nvme_checksum_errors_total",
            "nvme_checksum_errors_total",
        ),
        ("kvtier_nvme_io_errors_total", "nvme_io_errors_total"),
    ] {
        assert_eq!(get(&m, series), stat(&s, key), "{series} vs STATS {key}");
    }
    assert!(get(&m, "kvtier_tier_capacity_bytes{tier=\"nvme\"}") > 0.0);
    let fetches = get(&m, "kvtier_decode_stage_seconds_count{stage=\"fetch\"}");
    assert_eq!(fetches, requests, "one fetch observation per DECODE");
    let secs = get(&m, "kvtier_decode_stage_seconds_sum{stage=\"fetch\"}");
    let want = stat(&s, x::DECODE_FETCH_NS_TOTAL) / 1e9;
    assert!(
        (secs - want).abs() <= 1e-6 * want.max(1e-3),
        "fetch {secs} vs {want}"
    );

    // What this run does not have is absent, not zero: no GPU.
    for absent in ["gpu", "tier=\"gpu\"", "host_to_gpu"] {
        assert!(
            m.keys().all(|k| !k.contains(absent)),
            "{absent} exported without its component"
        );
    }

    // Only GET /metrics is served.
    let (status, _) = http(port, "GET / HTTP/1.1\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (status, _) = http(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
}

#[test]
fn an_unusable_metrics_address_fails_startup_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = tierd()
        .no_nvme()
        .set(&format!("metrics.listen=\"127.0.0.1:{port}\""))
        .output();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("metrics.listen 127.0.0.1:{port}")),
        "{err}"
    );
}

/// Flips bytes of one page payload in the page file, as a failing disk would.
fn damage(path: &std::path::Path, at: u64) {
    use std::io::{Seek, SeekFrom};
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[0x5A; 16]).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn a_corrupted_page_counts_one_checksum_error_in_stats_and_metrics() {
    let (d, port) = with_metrics(&["--set", "nvme.prefetch_blocks=0"]);
    let mut c = d.client();
    let (id, mut sh) = open(&mut c, "victim", 200, 8);
    c.demote(id).unwrap();
    let counters = |c: &mut kvtier_protocol::client::Client| {
        let s = c.stats().unwrap();
        let m = scrape(port);
        let pair = (
            stat(&s, "nvme_checksum_errors_total"),
            stat(&s, "nvme_io_errors_total"),
        );
        assert_eq!(
            pair,
            (
                get(&m, names::NVME_CHECKSUM_ERRORS),
                get(&m, names::NVME_IO_ERRORS)
            ),
            "STATS and metrics agree"
        );
        pair
    };
    assert_eq!(counters(&mut c), (0.0, 0.0));
    // The first page of a fresh store holds (layer 0, block 0), the sink block every keep-set
    // of layer 0 reads: damage its payload (past the 64-byte header).
    damage(&d.page_file(), 100);
    let (q, k, v) = sh.step_input(0);
    let qb = f32_bytes(&q);
    let e = c.decode(0, entry(id, 200, &qb, &k, &v), true).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::DataLoss), "{e}");
    assert_eq!(counters(&mut c), (1.0, 0.0), "one bad page read once");
    // Layer 1 is intact and still decodes.
    sh.decode(&mut c, id, 1);
    assert_eq!(counters(&mut c), (1.0, 0.0));
    // Each attempt that reads it counts again.
    assert_eq!(c.promote(id).unwrap_err().code(), Some(ErrorCode::DataLoss));
    assert_eq!(counters(&mut c), (2.0, 0.0));
}

#[test]
fn failed_nvme_reads_count_as_io_errors_in_stats_and_metrics() {
    let (d, port) = with_metrics(&["--set", "nvme.prefetch_blocks=0"]);
    let mut c = d.client();
    let (id, _) = open(&mut c, "cut short", 64, 9); // 4 blocks per layer
    assert_eq!(c.demote(id).unwrap(), 8);
    // The device shrinks under the daemon: every page read hits end of file and comes back
    // short, however often it is retried.
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.page_file())
        .unwrap()
        .set_len(0)
        .unwrap();
    let e = c.promote(id).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::DataLoss), "{e}");
    let s = c.stats().unwrap();
    let m = scrape(port);
    let io = stat(&s, "nvme_io_errors_total");
    // PROMOTE reads layer 0's four pages in one batch, all short, then stops.
    assert_eq!(io, 4.0);
    assert_eq!(get(&m, names::NVME_IO_ERRORS), io);
    assert_eq!(
        stat(&s, "nvme_checksum_errors_total"),
        0.0,
        "not corruption"
    );
    assert_eq!(get(&m, names::NVME_CHECKSUM_ERRORS), 0.0);
}
