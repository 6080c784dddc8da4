//! Writes the NVRTC PTX of the kernels for the Qwen2.5-7B geometry to the path given as the
//! first argument, for `ptxas -v` resource reports and to check that the kernels compile
//! without a GPU (needs libnvrtc only). Without more arguments: 128-token blocks and the
//! default policy; with `BLOCK_TOKENS TOP_K CANDIDATES`, the sketch selector at that block
//! size, top-k and candidate count (a sink of 128 tokens, a local window of 512), as
//! `bench/gpu/sketch.sh` runs it.

use kvtier_kernels::cuda::{compile_check, CudaConfig, SummaryDtype};
use kvtier_storage::{Geometry, Policy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: gpu_ptx OUT.ptx [BLOCK_TOKENS TOP_K CANDIDATES]";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or(usage)?;
    let cfg = match &args[1..] {
        [] => CudaConfig::qwen2_5_7b(),
        [bt, k, c] => {
            let (bt, k, c): (u32, u32, u32) = (bt.parse()?, k.parse()?, c.parse()?);
            if bt == 0 || 128 % bt != 0 && bt % 128 != 0 {
                return Err(
                    format!("{usage}: BLOCK_TOKENS divides or is a multiple of 128").into(),
                );
            }
            let g = Geometry {
                block_tokens: bt,
                ..Geometry::QWEN2_5_7B
            };
            let sink = 128u32.div_ceil(bt);
            let policy = Policy::sketch(sink, 512u32.div_ceil(bt), k, c);
            CudaConfig::new(g, policy, 8192, 8, SummaryDtype::F32)
        }
        _ => return Err(usage.into()),
    };
    std::fs::write(path, compile_check(&cfg)?)?;
    println!("wrote {path}");
    Ok(())
}
