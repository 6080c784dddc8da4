//! NVRTC compiles the kernel sources for several geometries. Needs libnvrtc, not a GPU;
//! skips (saying so) where libnvrtc is absent.
#![cfg(feature = "cuda")]

use kvtier_kernels::cuda::{compile_check, AttentionMath, CudaConfig, CudaError, SummaryDtype};
use kvtier_storage::{DType, Geometry, Policy};

fn cfg(hq: u32, hkv: u32, d: u32, b: u32, dtype: DType, sum: SummaryDtype) -> CudaConfig {
    let policy = Policy::bound(1, 2, 5);
    CudaConfig::new(Geometry::new(2, hq, hkv, d, dtype, b), policy, 64, 4, sum)
}

#[test]
fn kernels_compile_for_supported_geometries() {
    let cases = [
        cfg(28, 4, 128, 128, DType::Bf16, SummaryDtype::F32),
        cfg(28, 4, 128, 128, DType::Bf16, SummaryDtype::Bf16Outward),
        cfg(8, 8, 64, 16, DType::F16, SummaryDtype::F32),
        cfg(16, 2, 128, 32, DType::F32, SummaryDtype::F32),
        cfg(16, 4, 256, 64, DType::Bf16, SummaryDtype::F32),
        cfg(32, 8, 32, 16, DType::F32, SummaryDtype::Bf16Outward),
        // top_k > 32: the radix select over every score instead of the list merge.
        CudaConfig {
            policy: Policy::bound(1, 2, 40),
            cache_slots: 48,
            ..cfg(28, 4, 128, 128, DType::Bf16, SummaryDtype::F32)
        },
        // The sketch selector: quarter records in the scorer, the rerank of its candidates.
        CudaConfig {
            policy: Policy::sketch(1, 4, 8, 32),
            cache_slots: 26,
            ..cfg(28, 4, 128, 128, DType::Bf16, SummaryDtype::F32)
        },
        CudaConfig {
            policy: Policy::sketch(1, 2, 5, 12),
            ..cfg(4, 1, 256, 64, DType::Bf16, SummaryDtype::F32)
        },
        CudaConfig {
            policy: Policy::sketch(2, 3, 4, 4),
            ..cfg(8, 8, 64, 16, DType::F16, SummaryDtype::F32)
        },
        // Candidate lists of two and four keys per lane; top_k above 32 with the sketch.
        CudaConfig {
            policy: Policy::sketch(1, 4, 8, 64),
            cache_slots: 26,
            ..cfg(28, 4, 128, 128, DType::Bf16, SummaryDtype::F32)
        },
        CudaConfig {
            policy: Policy::sketch(1, 4, 40, 128),
            cache_slots: 48,
            ..cfg(28, 4, 128, 128, DType::Bf16, SummaryDtype::F32)
        },
        // The fp32 attention path for a geometry that would take tensor cores.
        CudaConfig {
            attention: AttentionMath::Simt,
            ..cfg(28, 4, 128, 128, DType::Bf16, SummaryDtype::F32)
        },
    ];
    for c in cases {
        match compile_check(&c) {
            Err(CudaError::NoNvrtc) => {
                println!("skipped: no NVRTC library");
                return;
            }
            Err(e) => panic!("{:?}: {e}", c.geometry),
            Ok(ptx) => {
                for k in [
                    "plan_fixed",
                    "select_score",
                    "select_topk",
                    "select_rerank",
                    "attend_tile",
                    "attend_merge",
                ] {
                    assert!(ptx.contains(&format!(".entry {k}")), "{k} missing from PTX");
                }
            }
        }
    }
}
