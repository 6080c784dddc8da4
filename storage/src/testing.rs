//! Deterministic random data for tests, benchmarks and the demo (not a cryptographic RNG).

/// Marsaglia's xorshift64 (shifts 13, 7, 17), the generator of the CUDA backend's tests and
/// benchmark; the seed must be non-zero.
#[derive(Debug, Clone)]
pub struct XorShift64(pub u64);

impl XorShift64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// SplitMix64: tiny, fast, and reproducible from a seed across platforms.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.uniform() as f64).max(1e-12);
        let u2 = self.uniform() as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// A fake cold source: copies of a session's block runs standing in for the NVMe tier where a
/// test needs a colder tier without files (the daemon's tests use the real page store). A block
/// that was not saved fails its read with `StorageError::ColdRead`, so an empty source is a
/// failing one.
#[derive(Debug, Default, Clone)]
pub struct SavedRuns(pub std::collections::HashMap<(u32, u32), Vec<u8>>);

impl SavedRuns {
    /// Every block run of every layer of `kv`, as it is now.
    pub fn of(kv: &crate::KvCache) -> Self {
        let mut m = std::collections::HashMap::new();
        for l in 0..kv.geometry().layers {
            for b in 0..kv.layer(l).expect("layer exists").blocks() as u32 {
                if let Some(run) = kv.run(l, b) {
                    m.insert((l, b), run.to_vec());
                }
            }
        }
        SavedRuns(m)
    }

    /// The saved run of (`layer`, `block`).
    pub fn run(&self, layer: u32, block: u32) -> &[u8] {
        &self.0[&(layer, block)]
    }
}

impl crate::ColdSource for SavedRuns {
    fn read_runs(
        &self,
        layer: u32,
        blocks: &[u32],
        extents: &mut [crate::Extent],
    ) -> crate::Result<()> {
        for (b, f) in blocks.iter().zip(extents) {
            let run = self
                .0
                .get(&(layer, *b))
                .ok_or(crate::StorageError::ColdRead {
                    tier: "the saved runs",
                    layer,
                    block: *b,
                    reason: "not saved".into(),
                    corrupt: false,
                })?;
            f.put_run(run);
        }
        Ok(())
    }
}
