//! A fake cold source: saved block runs standing in for the NVMe tier in tests of promotion
//! (the daemon's tests use the real page store).

use std::collections::HashMap;

use kvtier_storage::{ColdSource, Frame, KvCache, StorageError};

/// Block runs by (layer, block). A block that was not saved fails its read with
/// [`StorageError::ColdRead`], so an empty source is a failing one.
#[derive(Default, Clone)]
pub struct SavedRuns(HashMap<(u32, u32), Vec<u8>>);

impl SavedRuns {
    /// Every block of every layer of `kv` (all must be resident).
    pub fn of(kv: &KvCache) -> Self {
        let mut runs = HashMap::new();
        for l in 0..kv.geometry().layers {
            for b in 0..kv.layer(l).unwrap().blocks() as u32 {
                runs.insert((l, b), kv.run(l, b).unwrap().to_vec());
            }
        }
        SavedRuns(runs)
    }

    /// The saved run of (`layer`, `block`).
    pub fn run(&self, layer: u32, block: u32) -> &[u8] {
        &self.0[&(layer, block)]
    }
}

impl ColdSource for SavedRuns {
    fn read_runs(
        &self,
        layer: u32,
        blocks: &[u32],
        frames: &mut [Frame],
    ) -> kvtier_storage::Result<()> {
        for (b, f) in blocks.iter().zip(frames) {
            let run = self.0.get(&(layer, *b)).ok_or(StorageError::ColdRead {
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
