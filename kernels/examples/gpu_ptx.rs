//! Writes the NVRTC PTX of the kernels for the Qwen2.5-7B geometry (bf16, B=128, k=32) to the
//! path given as the first argument, for `ptxas -v` resource reports. Needs libnvrtc, no GPU.

use kvtier_kernels::cuda::{compile_check, AttentionMath, CudaConfig, SummaryDtype};
use kvtier_storage::{DType, Geometry, Policy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: gpu_ptx OUT.ptx")?;
    let cfg = CudaConfig {
        geometry: Geometry {
            layers: 28,
            q_heads: 28,
            kv_heads: 4,
            head_dim: 128,
            block_tokens: 128,
            dtype: DType::Bf16,
        },
        policy: Policy {
            sink_blocks: 1,
            local_blocks: 4,
            top_k: 32,
        },
        max_sessions: 8,
        max_blocks: 8192,
        max_batch: 8,
        cache_slots: 74,
        summary_dtype: SummaryDtype::F32,
        attention: AttentionMath::TensorCores,
    };
    std::fs::write(&path, compile_check(&cfg)?)?;
    println!("wrote {path}");
    Ok(())
}
