//! The dense baseline: attention over every block, KV in GPU memory and read from host.

use super::*;

/// Dense attention over every block (no selection), the baseline: KV in GPU memory (where it
/// fits) and read from host memory over PCIe. Medians of step device time.
pub(super) struct DenseRow {
    pub(super) ctx: u32,
    pub(super) batch: u32,
    pub(super) bytes: f64,
    /// None when the context does not fit in free GPU memory.
    pub(super) gpu_ms: Option<f64>,
    pub(super) host_ms: f64,
}

pub(super) fn run_dense(
    be: &mut CudaBackend,
    args: &Args,
    ctx: u32,
    batch: u32,
) -> Result<DenseRow, Box<dyn std::error::Error>> {
    let qs = Queries::new(batch, 0.0, 0xde45 + ctx as u64 + batch as u64);
    let items: Vec<StepItem> =
        qs.q.iter()
            .enumerate()
            .map(|(i, q)| StepItem { slot: i as u32, q })
            .collect();
    let slots: Vec<u32> = (0..batch).collect();
    let timed = |be: &mut CudaBackend,
                 kv: DenseKv,
                 steps: usize|
     -> Result<(f64, f64), Box<dyn std::error::Error>> {
        let mut ms = Vec::new();
        let mut bytes = 0.0;
        for step in 0..1 + steps {
            let out = be.dense_step(&items, kv)?;
            if !out.out.iter().all(|x| x.is_finite()) {
                return Err("non-finite dense output".into());
            }
            if step >= 1 {
                ms.push(out.step_ms.unwrap_or(f32::NAN) as f64);
            }
            bytes = out.stats.iter().map(|s| s.tiles as f64).sum::<f64>()
                * (2 * args.bt * D * 2) as f64;
        }
        Ok((median(&mut ms), bytes))
    };
    be.set_timing(Timing::Step)?;
    let (host_ms, bytes) = timed(be, DenseKv::Host, DENSE_HOST_STEPS)?;
    // In GPU memory where it fits, leaving 2 GB of headroom.
    let (free, _) = be.device_memory()?;
    let gpu_ms = if bytes + 2e9 < free as f64 {
        let kv = be.copy_kv_to_device(&slots)?;
        Some(timed(be, DenseKv::Device(&kv), args.steps)?.0)
    } else {
        None
    };
    Ok(DenseRow {
        ctx,
        batch,
        bytes,
        gpu_ms,
        host_ms,
    })
}
