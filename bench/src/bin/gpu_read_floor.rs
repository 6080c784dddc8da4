//! The selector's floor: how long a kernel that only reads a layer's block summaries once
//! takes on this GPU, timed the way gpu_bench times select_score (CUDA events around each
//! launch, one layer after another, every layer's summaries in their own buffer so that L2
//! holds none of them). Qwen2.5-7B at 1M tokens: 8192 blocks x 4 kv heads x 512 bytes (bf16
//! max + min) = 16.8 MB per layer, 28 layers.
//!
//! Usage: gpu_read_floor [--mb 16.78] [--layers 28] [--reps 20]
//!
//! Rows: an empty kernel (launch + event overhead alone); reads with a grid-stride loop (8
//! 16-byte loads in flight per thread) and with one contiguous chunk per thread block (how
//! select_score splits a layer), for several grid sizes of 256 threads, 256 being
//! select_score's grid at 1M tokens, batch 1 (4 kv heads x 64 thread blocks of 128 blocks).
//! `per launch` is the median of event pairs around
//! single launches (as gpu_bench's sel_us); `back to back` is the median of 28 launches between
//! two events, divided by 28 (no event between kernels).

mod common;

use common::{time, Res};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;
use kvtier_bench::each_flag;
use kvtier_kernels::cuda::device_context;

const SRC: &str = r#"
typedef unsigned long long u64;
extern "C" __global__ void empty(unsigned int* out) {
    if (threadIdx.x == 1024) out[0] = 1;
}
// mode 0: grid-stride; mode 1: thread block b reads vectors [b * chunk, (b + 1) * chunk).
extern "C" __global__ void read_floor(const uint4* __restrict__ p, u64 n, unsigned int mode,
                                      unsigned int* out) {
    uint4 a = make_uint4(0u, 0u, 0u, 0u);
    u64 i, end, stride;
    if (mode == 0) {
        stride = (u64)gridDim.x * blockDim.x;
        i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
        end = n;
    } else {
        const u64 chunk = (n + gridDim.x - 1) / gridDim.x;
        stride = blockDim.x;
        i = (u64)blockIdx.x * chunk + threadIdx.x;
        end = min(n, (u64)(blockIdx.x + 1) * chunk);
    }
    for (; i + 7 * stride < end; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __ldg(p + i + k * stride);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            a.x ^= v[k].x; a.y ^= v[k].y; a.z ^= v[k].z; a.w ^= v[k].w;
        }
    }
    for (; i < end; i += stride) {
        const uint4 v = __ldg(p + i);
        a.x ^= v.x; a.y ^= v.y; a.z ^= v.z; a.w ^= v.w;
    }
    // Never true for the zeroed buffers; keeps the loads.
    if ((a.x ^ a.y ^ a.z ^ a.w) == 0x9e3779b9u) out[0] = 1;
}
"#;

fn main() -> Res<()> {
    let (mut mb, mut layers, mut reps) = (16.777_216f64, 28usize, 20usize);
    each_flag(|k, v| match k {
        "--mb" => mb = v().parse().expect("--mb: megabytes"),
        "--layers" => layers = v().parse().expect("--layers: count"),
        "--reps" => reps = v().parse().expect("--reps: count"),
        _ => kvtier_bench::usage_error(format!("unknown argument {k}")),
    });
    let ctx = device_context(0)?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let read: CudaFunction = module.load_function("read_floor")?;
    let empty: CudaFunction = module.load_function("empty")?;
    let vecs = (mb * 1e6 / 16.0) as u64;
    let bufs: Vec<CudaSlice<u32>> = (0..layers)
        .map(|_| stream.alloc_zeros::<u32>(vecs as usize * 4))
        .collect::<Result<_, _>>()?;
    let out: CudaSlice<u32> = stream.alloc_zeros::<u32>(1)?;
    let sms = ctx.attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )? as u32;
    println!("device: {} ({sms} SMs)", ctx.name()?);
    println!(
        "command: {}",
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    println!(
        "{:.2} MB per layer x {layers} layers (each in its own buffer), {reps} reps, medians",
        vecs as f64 * 16.0 / 1e6
    );
    let one = |grid: u32| LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let launch_empty = |_: usize| -> Res<()> {
        let mut lb = stream.launch_builder(&empty);
        lb.arg(&out);
        // SAFETY: `empty` takes one device pointer, which `out` is.
        unsafe { lb.launch(one(1)) }?;
        Ok(())
    };
    let e1 = time(&stream, reps * layers, 1, launch_empty)?;
    let e28 = time(&stream, reps, layers, launch_empty)?;
    println!(
        "{:>22} {:>6} {:>14} {:>14}",
        "kernel", "grid", "per launch us", "back to back us"
    );
    println!("{:>22} {:>6} {:>14.2} {:>14.2}", "empty", 1, e1, e28);
    for mode in [0u32, 1] {
        for grid in [sms, 256, 2 * sms, 4 * sms, 8 * sms] {
            let launch = |k: usize| -> Res<()> {
                let mut lb = stream.launch_builder(&read);
                lb.arg(&bufs[k % layers]).arg(&vecs).arg(&mode).arg(&out);
                // SAFETY: read_floor takes (const uint4*, u64 n, u32 mode, u32*): the buffer
                // holds n 16-byte vectors (4 n u32), out one u32.
                unsafe { lb.launch(one(grid)) }?;
                Ok(())
            };
            let t1 = time(&stream, reps * layers, 1, launch)?;
            let t28 = time(&stream, reps, layers, launch)?;
            let gbs = |us: f64| vecs as f64 * 16.0 / us / 1e3;
            println!(
                "{:>22} {:>6} {:>8.2} ({:>4.0} GB/s) {:>8.2} ({:>4.0} GB/s)",
                if mode == 0 {
                    "read, grid-stride"
                } else {
                    "read, chunk per block"
                },
                grid,
                t1,
                gbs(t1),
                t28,
                gbs(t28)
            );
        }
    }
    Ok(())
}
