//! Block runs held in memory, read back as a colder tier's would be.

use super::{ColdSource, KvCache};
use crate::arena::Extent;
use crate::error::{Result, StorageError};

/// Block runs held in memory, as a cold source: runs read from the remote tier ahead of need,
/// and copies of a session's runs standing in for the NVMe tier where a test needs a colder
/// tier without files. A block not held fails its read with `StorageError::ColdRead`, so an
/// empty source is a failing one.
#[derive(Debug, Default, Clone)]
pub struct SavedRuns(pub std::collections::HashMap<(u32, u32), Vec<u8>>);

impl SavedRuns {
    /// Every block run of every layer of `kv`, as it is now.
    pub fn of(kv: &KvCache) -> Self {
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

    /// The run of (`layer`, `block`), if held.
    pub fn get(&self, layer: u32, block: u32) -> Option<&[u8]> {
        self.0.get(&(layer, block)).map(Vec::as_slice)
    }

    /// The saved run of (`layer`, `block`).
    pub fn run(&self, layer: u32, block: u32) -> &[u8] {
        &self.0[&(layer, block)]
    }
}

impl ColdSource for SavedRuns {
    fn read_runs(&self, layer: u32, blocks: &[u32], extents: &mut [Extent]) -> Result<()> {
        for (b, f) in blocks.iter().zip(extents) {
            let run = self.0.get(&(layer, *b)).ok_or_else(|| {
                StorageError::cold_read("runs held in memory", layer, *b, "not held", false)
            })?;
            f.put_run(run);
        }
        Ok(())
    }
}
