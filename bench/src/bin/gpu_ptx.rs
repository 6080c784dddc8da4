//! Writes the NVRTC PTX of the kernels for the Qwen2.5-7B geometry (bf16, B=128, k=32) to the
//! path given as the first argument, for `ptxas -v` resource reports. Needs libnvrtc, no GPU.

use kvtier_kernels::cuda::{compile_check, CudaConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: gpu_ptx OUT.ptx")?;
    let cfg = CudaConfig::qwen2_5_7b();
    std::fs::write(&path, compile_check(&cfg)?)?;
    println!("wrote {path}");
    Ok(())
}
