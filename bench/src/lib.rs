//! Shared helpers of the kvtier benchmark binaries.

pub mod daemon;

use std::time::Duration;

use kvtier_kernels::{decode_cpu_timed, DecodeEntry, StageTimings, StepStats};
use kvtier_storage::testing::Rng;
use kvtier_storage::{ColdSource, KvCache, Policy};

/// Fills `bytes` with random bf16 values of magnitude in [2^-5, 1), four per RNG call: fast
/// enough to fill a 7.5 GB cache in seconds, with enough spread that block bounds differ.
pub fn fill_bf16(rng: &mut Rng, bytes: &mut [u8]) {
    for chunk in bytes.chunks_mut(8) {
        let r = rng.next_u64();
        for (i, b) in chunk.chunks_exact_mut(2).enumerate() {
            let x = (r >> (16 * i)) as u16;
            // sign + 7 mantissa bits from x; exponent 2^-1 .. 2^-5 from 2 more bits.
            let exp = 126 - ((x >> 7) & 3);
            let v = (x & 0x807F) | (exp << 7);
            b.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Walks the command line as `--flag VALUE` pairs and bare flags: `flag` gets each flag's name
/// and `val`, which takes the next argument as its value (a [`usage_error`] naming the flag
/// where there is none).
pub fn each_flag(mut flag: impl FnMut(&str, &mut dyn FnMut() -> String)) {
    let mut it = std::env::args().skip(1);
    while let Some(name) = it.next() {
        let mut val = || {
            it.next()
                .unwrap_or_else(|| usage_error(format!("{name} needs a value")))
        };
        flag(&name, &mut val);
    }
}

/// Ends the program on a command-line mistake: the binary's name and `msg` on stderr, exit
/// status 2 (a usage error, not a panic).
pub fn usage_error(msg: impl std::fmt::Display) -> ! {
    let arg0 = std::env::args().next().unwrap_or_default();
    let name = std::path::Path::new(&arg0)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or(arg0);
    eprintln!("{name}: {msg}");
    std::process::exit(2)
}

/// `value` of `flag` parsed, or a [`usage_error`] saying what the flag takes.
pub fn parse_flag<T: std::str::FromStr>(flag: &str, value: &str, what: &str) -> T {
    value
        .parse()
        .unwrap_or_else(|_| usage_error(format!("{flag} takes {what}, not {value:?}")))
}

/// Nearest-rank percentile `p` (0..=100) of an ascending slice; zero for an empty one.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A measurement the benchmarks take medians of: seconds or milliseconds as f64 (in their
/// total order; NaN when there are none) or a Duration (zero when there are none).
pub trait Sample: Copy {
    const NONE: Self;
    fn order(&self, other: &Self) -> std::cmp::Ordering;
}

impl Sample for f64 {
    const NONE: f64 = f64::NAN;
    fn order(&self, other: &Self) -> std::cmp::Ordering {
        self.total_cmp(other)
    }
}

impl Sample for Duration {
    const NONE: Duration = Duration::ZERO;
    fn order(&self, other: &Self) -> std::cmp::Ordering {
        self.cmp(other)
    }
}

/// The median (the upper of the middle two) of `xs`, which it sorts; [`Sample::NONE`] for none.
pub fn median<T: Sample>(xs: &mut [T]) -> T {
    xs.sort_unstable_by(T::order);
    xs.get(xs.len() / 2).copied().unwrap_or(T::NONE)
}

/// One line describing the CPU this ran on (model name and core count).
pub fn cpu_description() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model}, {cores} cores")
}

pub fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// CPU time (user + system) consumed by this process so far, all threads. Unlike wall time it
/// is not inflated when other processes share the cores, so it compares kernel variants on a
/// busy machine; wall time stays the figure of record.
pub fn process_cpu_time() -> Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a full `rusage` into the pointer we pass and reads nothing.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: getrusage succeeded, so the struct is initialised.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// One decode step over every layer of `kv` (batch 1): a random query and a random new token
/// per layer, cold blocks read from `cold`. Returns each layer's stats.
pub fn decode_step(
    kv: &mut KvCache,
    policy: Policy,
    cold: Option<&dyn ColdSource>,
    rng: &mut Rng,
) -> Vec<StepStats> {
    decode_step_timed(kv, policy, cold, rng).0
}

/// [`decode_step`], also returning its stage timings summed over the layers.
pub fn decode_step_timed(
    kv: &mut KvCache,
    policy: Policy,
    cold: Option<&dyn ColdSource>,
    rng: &mut Rng,
) -> (Vec<StepStats>, StageTimings) {
    let g = *kv.geometry();
    let q = rng.normals((g.q_heads * g.head_dim) as usize);
    let mut out = vec![0f32; q.len()];
    let mut kvb = vec![0u8; 2 * g.token_bytes()];
    let mut sum = StageTimings::default();
    let stats = (0..g.layers)
        .map(|layer| {
            fill_bf16(rng, &mut kvb);
            let (k, v) = kvb.split_at(g.token_bytes());
            let position = kv.tokens(layer).expect("layer");
            let entry = DecodeEntry {
                session: 0,
                layer,
                kv: &mut *kv,
                policy,
                position,
                q: &q,
                k,
                v,
                cold,
            };
            let mut t = StageTimings::default();
            let st = decode_cpu_timed(&mut [entry], &mut out, &mut t)
                .expect("decode")
                .remove(0);
            sum.append_ns += t.append_ns;
            sum.select_ns += t.select_ns;
            sum.fetch_ns += t.fetch_ns;
            sum.attend_ns += t.attend_ns;
            st
        })
        .collect();
    (stats, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let ms: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&ms, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&ms, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&ms, 100.0), Duration::from_millis(100));
        assert_eq!(percentile(&ms, 0.0), Duration::from_millis(1));
        assert_eq!(percentile(&ms[..1], 99.0), Duration::from_millis(1));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }
}
