//! How much of the host tier mixed geometries can use before the extent allocator fragments.
//!
//! Simulates the arena's allocator (`Extents` in 4 KiB units, 1 GiB segments)
//! under sessions of several run sizes that grow block by block, interleaved, and close at
//! random, keeping the tier near full. An allocation that fails although at least its size is
//! free is a *fragmentation* failure; the figure of merit is the fill (bytes used / capacity)
//! at the moment of each failure. Nothing is mapped or touched: only the allocator runs.
//!
//! cargo run --release -p kvtier-bench --bin extent_churn -- [capacity_gib] [steps]

use kvtier_storage::extents::Extents;
use kvtier_storage::testing::Rng;

const UNIT: u64 = 4096;
const SEGMENT: u64 = kvtier_storage::arena::SEGMENT_BYTES as u64 / UNIT;

struct Session {
    run_units: u64,
    target_blocks: u64,
    extents: Vec<u64>,
}

/// (name, run bytes) of the mixes simulated.
fn mixes() -> Vec<(&'static str, Vec<u64>)> {
    let kib = |k: u64| k << 10;
    vec![
        ("one size (512 KiB)", vec![kib(512)]),
        ("one size (5 MiB, Llama-2-13B f32)", vec![kib(5120)]),
        ("two sizes (256 KiB, 512 KiB)", vec![kib(256), kib(512)]),
        (
            "seven sizes (32 KiB .. 8 MiB)",
            vec![
                kib(32),
                kib(128),
                kib(256),
                kib(512),
                kib(1280),
                kib(2048),
                kib(8192),
            ],
        ),
        (
            "small and odd (32, 160, 1280 KiB)",
            vec![kib(32), kib(160), kib(1280)],
        ),
    ]
}

fn run(capacity: u64, sizes: &[u64], steps: u64, seed: u64) -> (u64, u64, f64, f64) {
    let mut rng = Rng::new(seed);
    let mut space = Extents::new(capacity / UNIT, SEGMENT);
    let mut live: Vec<Session> = Vec::new();
    let (mut frag_failures, mut full_failures) = (0u64, 0u64);
    let mut fill_at_failure = Vec::new();
    let mut fill_sum = 0.0;
    for _ in 0..steps {
        // Open a session now and then, more often while the tier has room.
        let fill = space.used() as f64 / space.total() as f64;
        if live.is_empty() || rng.next_u64().is_multiple_of(16) {
            let run = sizes[(rng.next_u64() % sizes.len() as u64) as usize];
            // Sessions of 1/64 .. 1/8 of the tier.
            let bytes = capacity / 64 + rng.next_u64() % (capacity / 8);
            live.push(Session {
                run_units: run.div_ceil(UNIT),
                target_blocks: (bytes / run).max(1),
                extents: Vec::new(),
            });
        }
        // One block for a random growing session.
        let i = (rng.next_u64() % live.len() as u64) as usize;
        let s = &mut live[i];
        if (s.extents.len() as u64) < s.target_blocks {
            match space.alloc(s.run_units) {
                Some(at) => s.extents.push(at),
                None => {
                    if space.free() >= s.run_units {
                        frag_failures += 1;
                    } else {
                        full_failures += 1;
                    }
                    fill_at_failure.push(fill);
                    // Memory pressure: the least recently opened session goes (demoted).
                    let old = live.remove(0);
                    for at in old.extents {
                        assert!(space.release(at, old.run_units));
                    }
                }
            }
        } else if rng.next_u64().is_multiple_of(4) {
            // A finished session closes.
            let done = live.swap_remove(i);
            for at in done.extents {
                assert!(space.release(at, done.run_units));
            }
        }
        fill_sum += space.used() as f64 / space.total() as f64;
    }
    fill_at_failure.sort_by(f64::total_cmp);
    let median = fill_at_failure
        .get(fill_at_failure.len() / 2)
        .copied()
        .unwrap_or(f64::NAN);
    (
        frag_failures,
        full_failures,
        median,
        fill_sum / steps as f64,
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gib: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(64);
    let steps: u64 = args
        .get(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2_000_000);
    let capacity = gib << 30;
    println!("extent churn: {gib} GiB tier, 1 GiB segments, {steps} steps per mix, 3 seeds each");
    println!(
        "{:<36} {:>10} {:>10} {:>18} {:>10}",
        "mix", "frag fail", "full fail", "fill at failure", "mean fill"
    );
    for (name, sizes) in mixes() {
        for seed in 1..=3 {
            let (frag, full, at_fail, mean) = run(capacity, &sizes, steps, seed);
            println!(
                "{name:<36} {frag:>10} {full:>10} {:>17.1}% {:>9.1}%",
                at_fail * 100.0,
                mean * 100.0
            );
        }
    }
}
