//! How fast can thread blocks read a layer's keep-set tiles from mapped pinned host memory
//! (zero-copy over PCIe), as a function of how many thread blocks share a tile? The cold
//! k=8 batch-1 step reads 52 tiles of 64 KiB per layer (13 per kv head) with one thread block
//! per tile, and moves them at ~46 GB/s against 55.3 GB/s for the copy engines; this tool
//! separates the reads from the attention to see whether spreading a tile's loads over more
//! thread blocks (and so more multiprocessors) moves more bytes per second.
//!
//! Usage: gpu_zero_copy [--host-gb 8] [--tiles 20,32,52,148,416] [--splits 1,2,4,8]
//!                      [--layers 28] [--reps 20]
//!
//! Every launch reads `tiles` tiles of 64 KiB at random 64 KiB-aligned positions of a pinned,
//! device-mapped host buffer (a fresh draw per launch, so neither L2 nor the GPU's TLBs hold
//! them from the launch before); `split` thread blocks of 256 threads per tile each read a
//! contiguous 1/split of it, all of a thread's 16-byte loads in flight at once (16 per thread
//! at split 1, as attend_tile does with K and V). `per launch` is the median of event pairs
//! around single launches (as gpu_bench times a step); the floor is bytes / 55.3 GB/s. The DMA
//! row copies the same bytes (one contiguous range) with one cuMemcpyHtoDAsync.

mod common;

use common::{time, Res};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;
use kvtier_bench::each_flag;
use kvtier_kernels::cuda::{device_context, AnonMapping, PinnedRegion};

const TILE: usize = 64 << 10;
const THREADS: u32 = 256;
/// The measured bulk host -> GPU rate (../shared/DESIGN.md, "Measured physical limits").
const FLOOR_GBS: f64 = 55.3;
// A whole tile fits read_tiles's MAXL (16) loads per thread, so every split reads it all.
const _: () = assert!(TILE / 16 <= 16 * THREADS as usize);

const SRC: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
#define MAXL 16
// Thread block b reads share (b % split) of tile (b / split); tile_vecs / split 16-byte
// vectors, at most MAXL per thread, all issued before any is used.
extern "C" __global__ void read_tiles(const u64* __restrict__ tiles, u32 tile_vecs, u32 split, u32* out) {
    const u32 per = tile_vecs / split;
    const uint4* p = (const uint4*)tiles[blockIdx.x / split] + (blockIdx.x % split) * per;
    uint4 v[MAXL];
#pragma unroll
    for (int k = 0; k < MAXL; ++k) {
        const u32 x = threadIdx.x + k * blockDim.x;
        v[k] = x < per ? p[x] : make_uint4(0u, 0u, 0u, 0u);
    }
    u32 a = 0;
#pragma unroll
    for (int k = 0; k < MAXL; ++k) a ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    // Never true for the zeroed buffer; keeps the loads.
    if (a == 0x9e3779b9u) out[0] = 1;
}
"#;

fn list(flag: &str, v: &str) -> Vec<usize> {
    v.split(',')
        .map(|x| {
            x.parse()
                .unwrap_or_else(|_| panic!("{flag}: comma-separated counts"))
        })
        .collect()
}

fn main() -> Res<()> {
    let (mut host_gb, mut layers, mut reps) = (8usize, 28usize, 20usize);
    let mut tiles_list = vec![20, 32, 52, 148, 416];
    let mut splits = vec![1, 2, 4, 8];
    each_flag(|k, v| match k {
        "--host-gb" => host_gb = v().parse().expect("--host-gb: gigabytes"),
        "--layers" => layers = v().parse().expect("--layers: count"),
        "--reps" => reps = v().parse().expect("--reps: count"),
        "--tiles" => tiles_list = list(k, &v()),
        "--splits" => splits = list(k, &v()),
        _ => kvtier_bench::usage_error(format!("unknown argument {k}")),
    });
    if splits
        .iter()
        .any(|&s| s == 0 || !(TILE / 16).is_multiple_of(s))
    {
        return Err("each split must divide 4096 and be at least 1".into());
    }
    let ctx = device_context(0)?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let read = module.load_function("read_tiles")?;
    let sms = ctx.attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    println!("device: {} ({sms} SMs)", ctx.name()?);
    println!(
        "command: {}",
        std::env::args().collect::<Vec<_>>().join(" ")
    );

    let len = host_gb << 30;
    let region = PinnedRegion::register_owned(&ctx, AnonMapping::new(len)?)?;
    let ntiles = len / TILE;
    println!(
        "{host_gb} GiB pinned mapped host buffer ({ntiles} tiles of 64 KiB, {} registration chunks); \
         {} launches per row ({layers} layers x {reps} reps), a fresh random draw of tiles each; medians",
        region.chunk_count(),
        layers * reps
    );
    let out: CudaSlice<u32> = stream.alloc_zeros(1)?;
    let launches = layers * reps;
    let max_tiles = *tiles_list.iter().max().unwrap_or(&1);
    // A small xorshift: reproducible draws without a dependency.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut offs = Vec::with_capacity(launches * max_tiles);
    let mut addrs = Vec::with_capacity(launches * max_tiles);
    for _ in 0..launches * max_tiles {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let off = (s % ntiles as u64) as usize * TILE;
        offs.push(off);
        addrs.push(region.device_addr(off as u64, TILE as u64)?);
    }
    let addrs_dev = stream.clone_htod(&addrs)?;
    let dst: CudaSlice<u8> = stream.alloc_zeros(max_tiles * TILE)?;
    let host = region.host().ok_or("owned region has host bytes")?;

    println!(
        "{:>6} {:>9} {:>6} {:>7} {:>13} {:>8} {:>9}",
        "tiles", "MB", "split", "blocks", "per launch us", "GB/s", "x floor"
    );
    for &tiles in &tiles_list {
        let bytes = (tiles * TILE) as f64;
        let floor_us = bytes / FLOOR_GBS / 1e3;
        let row = |what: &str, blocks: String, us: f64| {
            println!(
                "{:>6} {:>9.3} {:>6} {:>7} {:>13.2} {:>8.1} {:>9.3}",
                tiles,
                bytes / 1e6,
                what,
                blocks,
                us,
                bytes / us / 1e3,
                us / floor_us
            )
        };
        for &split in &splits {
            let (vecs, sp) = ((TILE / 16) as u32, split as u32);
            let grid = (tiles * split) as u32;
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let us = time(&stream, launches, 1, |k| {
                let k = k % launches;
                let view = addrs_dev.slice(k * max_tiles..k * max_tiles + tiles);
                let mut lb = stream.launch_builder(&read);
                lb.arg(&view).arg(&vecs).arg(&sp).arg(&out);
                // SAFETY: read_tiles takes (const u64* tiles, u32 tile_vecs, u32 split, u32* out);
                // `view` holds `tiles` device addresses of 64 KiB mapped host ranges (checked by
                // device_addr), grid = tiles * split, and out is one u32.
                unsafe { lb.launch(cfg) }?;
                Ok(())
            })?;
            row(&split.to_string(), grid.to_string(), us);
        }
        let (dptr, _sync) = dst.device_ptr(&stream);
        let us = time(&stream, launches, 1, |k| {
            let k = k % launches;
            let off = offs[k * max_tiles].min(len - tiles * TILE);
            // SAFETY: dst holds max_tiles * TILE >= tiles * TILE bytes; the source range lies in
            // the pinned region's owned mapping, which outlives the copy (synchronized by the
            // event in time before the next iteration).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dptr,
                    &host[off..off + tiles * TILE],
                    stream.cu_stream(),
                )
            }?;
            Ok(())
        })?;
        row("DMA", "-".into(), us);
    }
    Ok(())
}
