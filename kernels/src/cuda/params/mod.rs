//! Kernel parameters, declared once for Rust and CUDA.
//!
//! Each kernel's parameters are one `#[repr(C)]` Rust struct, declared in the
//! `kernel_params!` invocation below, which also generates the kernel's C parameter list:
//! `#define PlanFixedParams_FIELDS const u32* __restrict__ ntok, unsigned int max_blocks, ...`.
//! module.rs puts those definitions into the NVRTC source between common.cuh and the kernels
//! ([`cuda_decls!`]), and each kernel is declared with its list
//! (`plan_fixed(PlanFixedParams_FIELDS)`), so the body reads its parameters as before. The
//! backend passes a kernel the struct, each field one kernel parameter in declaration order
//! ([`KernelParams::push_args`], [`KernelParams::arg_ptrs`]): nothing is matched by hand.
//!
//! Rust -> C types (fixed): `u32` -> `unsigned int`, `i32` -> `int`, `u64` -> `unsigned long
//! long`, `f32` -> `float`; a device address is a `u64` on the Rust side and names its C pointer
//! type (`u64 as "const float* __restrict__"`), with the qualifiers the kernel's parameter has.
//! The tests check each generated list against the Rust fields (order, names, sizes) and each
//! kernel's signature in the source.
//!
//! Why a parameter list and not the struct by value: `__restrict__` on a kernel's own pointer
//! parameters is what lets NVRTC load read-only data through the non-coherent path
//! (`ld.global.nc`). Members of a by-value struct lose that (also when the body is an inlined
//! function with `__restrict__` parameters): NVRTC 13.5 then emits plain `ld.global` in
//! plan_fixed, attend_tile, attend_dense, attend_merge and part of select_score and
//! layer_fused. Separate parameters keep the PTX byte for byte as it was with hand-written
//! signatures (NVRTC 13.5, the gpu_compile geometries).

use std::ffi::c_void;

use cudarc::driver::LaunchArgs;

/// A kernel's parameters: its name, its generated C parameter list, and the launch arguments.
pub(crate) trait KernelParams {
    /// The kernel's `extern "C"` name (and the name its launch errors carry).
    const KERNEL: &'static str;
    /// The C definition of the kernel's parameter list, `#define Name_FIELDS ...`.
    #[cfg_attr(not(test), allow(dead_code))]
    const CUDA_DECL: &'static str;
    /// Field names, offsets and sizes on the Rust side, in declaration order.
    #[cfg_attr(not(test), allow(dead_code))]
    const FIELDS: &'static [Field];

    /// Pushes each field, in declaration order, as one kernel argument.
    fn push_args<'a>(&'a self, args: &mut LaunchArgs<'a>);

    /// The address of each field, in declaration order: `kernelParams` of cuLaunchKernelEx,
    /// valid while `self` is.
    fn arg_ptrs(&self) -> Vec<*mut c_void>;
}

/// One field of a parameter struct on the Rust side.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
    /// A device address (its C type is a pointer).
    pub pointer: bool,
}

/// The C type of a field: the fixed map for scalars, the given pointer type for a device
/// address (only a `u64` can be one).
macro_rules! c_type {
    (u32) => {
        "unsigned int"
    };
    (i32) => {
        "int"
    };
    (u64) => {
        "unsigned long long"
    };
    (f32) => {
        "float"
    };
    (u64 as $c:literal) => {
        $c
    };
}

/// The fields as a comma-separated C parameter list, `T a, U b` (a string literal).
macro_rules! c_list {
    ($field:ident: $ty:ident $(as $cty:literal)?, $($rest:tt)+) => {
        concat!(
            crate::cuda::params::c_list!($field: $ty $(as $cty)?,),
            ", ",
            crate::cuda::params::c_list!($($rest)+)
        )
    };
    ($field:ident: $ty:ident $(as $cty:literal)?,) => {
        concat!(crate::cuda::params::c_type!($ty $(as $cty)?), " ", stringify!($field))
    };
}

/// The C definition of one kernel's parameter list (a string literal).
macro_rules! c_decl {
    ($name:ident { $($field:ident: $ty:ident $(as $cty:literal)?,)+ }) => {
        concat!(
            "#define ",
            stringify!($name),
            "_FIELDS ",
            crate::cuda::params::c_list!($($field: $ty $(as $cty)?,)+),
            "\n"
        )
    };
}

/// Is a field a device address (declared with a C pointer type)?
macro_rules! is_pointer {
    ($ty:ident) => {
        false
    };
    ($ty:ident as $c:literal) => {
        true
    };
}

/// Declares each kernel's parameters once: the `#[repr(C)]` Rust struct, its [`KernelParams`]
/// (kernel name, C parameter list, layout, launch arguments), and [`cuda_decls!`], the C
/// definitions of every list (a string literal, for `concat!`).
macro_rules! kernel_params {
    ($(
        $(#[doc = $doc:literal])*
        $kernel:ident => $name:ident {
            $($field:ident: $ty:ident $(as $cty:literal)?,)+
        }
    )*) => {
        $(
            $(#[doc = $doc])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug)]
            pub(crate) struct $name {
                $(pub $field: $ty,)+
            }

            impl KernelParams for $name {
                const KERNEL: &'static str = stringify!($kernel);
                const CUDA_DECL: &'static str = c_decl!($name { $($field: $ty $(as $cty)?,)+ });
                const FIELDS: &'static [Field] = &[$(Field {
                    name: stringify!($field),
                    offset: std::mem::offset_of!($name, $field),
                    size: std::mem::size_of::<$ty>(),
                    pointer: is_pointer!($ty $(as $cty)?),
                },)+];

                fn push_args<'a>(&'a self, args: &mut LaunchArgs<'a>) {
                    use cudarc::driver::PushKernelArg;
                    $(args.arg(&self.$field);)+
                }

                fn arg_ptrs(&self) -> Vec<*mut c_void> {
                    vec![$(&self.$field as *const $ty as *mut c_void,)+]
                }
            }
        )*

        /// The C definitions of every kernel's parameter list, one string literal.
        macro_rules! cuda_decls {
            () => {
                concat!($(crate::cuda::params::c_decl!($name { $($field: $ty $(as $cty)?,)+ }),)*)
            };
        }

        /// Every parameter struct: kernel name, C definition and Rust fields.
        #[cfg(test)]
        pub(crate) const ALL: &[(&str, &str, &[Field])] = &[$((
            <$name as KernelParams>::KERNEL,
            <$name as KernelParams>::CUDA_DECL,
            <$name as KernelParams>::FIELDS,
        ),)*];
    };
}

pub(crate) use {c_decl, c_list, c_type};

kernel_params! {
    /// plan_fixed (gather.cu): plans the fixed part (sink and local window) of each keep-set.
    plan_fixed => PlanFixedParams {
        ntok: u64 as "const u32* __restrict__",
        max_blocks: u32,
        table: u64 as "u32*",
        counts: u64 as "u32* __restrict__",
        sess: u64 as "const u32* __restrict__",
        layer: u32,
        tags: u64 as "u32* __restrict__",
        stamps: u64 as "u32* __restrict__",
        pages: u64 as "const u64* __restrict__",
        slot_of: u64 as "u32* __restrict__",
        miss_src: u64 as "u64* __restrict__",
        stats: u64 as "unsigned long long* __restrict__",
    }

    /// attend_tile (attend.cu): fetch + attention of the fixed (`part` 0) or distant (1) tiles.
    attend_tile => AttendTileParams {
        q: u64 as "const float* __restrict__",
        sess: u64 as "const u32* __restrict__",
        ntok: u64 as "const u32* __restrict__",
        layer: u32,
        table: u64 as "const u32* __restrict__",
        slot_of: u64 as "const u32* __restrict__",
        miss_src: u64 as "const u64* __restrict__",
        cache: u64 as "uint4* __restrict__",
        scale: f32,
        part_acc: u64 as "float* __restrict__",
        part_ml: u64 as "float* __restrict__",
        part: u32,
    }

    /// attend_dense (attend.cu): dense attention over every block (the benchmark's baseline).
    attend_dense => AttendDenseParams {
        q: u64 as "const float* __restrict__",
        sess: u64 as "const u32* __restrict__",
        ntok: u64 as "const u32* __restrict__",
        layer: u32,
        max_blocks: u32,
        pages: u64 as "const u64* __restrict__",
        scale: f32,
        part_acc: u64 as "float* __restrict__",
        part_ml: u64 as "float* __restrict__",
    }

    /// dense_merge_part (attend.cu): the dense merge's first step.
    dense_merge_part => DenseMergePartParams {
        ntok: u64 as "const u32* __restrict__",
        max_blocks: u32,
        part_acc: u64 as "const float* __restrict__",
        part_ml: u64 as "const float* __restrict__",
        st_acc: u64 as "float* __restrict__",
        st_ml: u64 as "float* __restrict__",
    }

    /// dense_merge_out (attend.cu): the dense merge's second step.
    dense_merge_out => DenseMergeOutParams {
        splits: u32,
        st_acc: u64 as "const float* __restrict__",
        st_ml: u64 as "const float* __restrict__",
        out: u64 as "float* __restrict__",
    }

    /// copy_runs (attend.cu): copies a session's block runs into GPU memory.
    copy_runs => CopyRunsParams {
        from: u64 as "const u64* __restrict__",
        to: u64 as "const u64* __restrict__",
        max_blocks: u32,
        n_blocks: u32,
        run_vecs: u64,
    }

    /// attend_merge (attend.cu): the log-sum-exp merge of a layer's partials.
    attend_merge => AttendMergeParams {
        counts: u64 as "const u32* __restrict__",
        part_acc: u64 as "const float* __restrict__",
        part_ml: u64 as "const float* __restrict__",
        out: u64 as "float* __restrict__",
        // [batch][Hq] log-sum-exp of each output, or 0 for none.
        lse: u64 as "float*",
        // An engine's tail (device calls; 0 for none): tokens it holds on the GPU, attended
        // here as one more partial. q [batch][Hq x D] f32; tail_kv [batch][Hkv][K, V][bt][D]
        // in the sessions' dtype (a block run's layout); rows 0..=tail_last[i] are attended.
        q: u64 as "const float* __restrict__",
        tail_kv: u64 as "const elem_t* __restrict__",
        tail_last: u64 as "const long long* __restrict__",
        scale: f32,
    }

    /// select_score (select.cu): the selector (scores, top-k for top_k <= 32, distant plan).
    select_score => SelectScoreParams {
        q: u64 as "const float* __restrict__",
        sums: u64 as "const sum_t* __restrict__",
        // The sketch selector's quarter-code scales [slot][layer][max_blocks][KV_HEADS] (unused
        // without it).
        qscales: u64 as "const float* __restrict__",
        sess: u64 as "const u32* __restrict__",
        ntok: u64 as "const u32* __restrict__",
        layer: u32,
        max_blocks: u32,
        nbo: u32,
        scratch: u64 as "void* __restrict__",
        done: u64 as "u32* __restrict__",
        table: u64 as "u32*",
        tags: u64 as "u32* __restrict__",
        stamps: u64 as "u32* __restrict__",
        pages: u64 as "const u64* __restrict__",
        slot_of: u64 as "u32* __restrict__",
        miss_src: u64 as "u64* __restrict__",
        stats: u64 as "unsigned long long* __restrict__",
        // The sketch selector's candidates [batch][KV_HEADS][32 * LIST_R] (unused without it).
        cands: u64 as "u32*",
    }

    /// select_rerank (select.cu): the sketch selector's second stage (candidates scored by
    /// their key sketches, the top-k and the distant plan).
    select_rerank => SelectRerankParams {
        q: u64 as "const float* __restrict__",
        sketches: u64 as "const unsigned char* __restrict__",
        sess: u64 as "const u32* __restrict__",
        ntok: u64 as "const u32* __restrict__",
        layer: u32,
        max_blocks: u32,
        cands: u64 as "const u32*",
        rkeys: u64 as "u64*",
        rdone: u64 as "u32* __restrict__",
        table: u64 as "u32*",
        tags: u64 as "u32* __restrict__",
        stamps: u64 as "u32* __restrict__",
        pages: u64 as "const u64* __restrict__",
        slot_of: u64 as "u32* __restrict__",
        miss_src: u64 as "u64* __restrict__",
        stats: u64 as "unsigned long long* __restrict__",
    }

    /// layer_fused (select.cu): a whole layer but the merge in one launch; select_score's
    /// parameters (slot_of and miss_src without `__restrict__`: this launch writes and reads
    /// them), the stamp its ready flags hand off with (unique per call, never 0), then the
    /// attention's.
    layer_fused => LayerFusedParams {
        q: u64 as "const float* __restrict__",
        sums: u64 as "const sum_t* __restrict__",
        qscales: u64 as "const float* __restrict__",
        sess: u64 as "const u32* __restrict__",
        ntok: u64 as "const u32* __restrict__",
        layer: u32,
        max_blocks: u32,
        nbo: u32,
        scratch: u64 as "void* __restrict__",
        done: u64 as "u32* __restrict__",
        table: u64 as "u32*",
        tags: u64 as "u32* __restrict__",
        stamps: u64 as "u32* __restrict__",
        pages: u64 as "const u64* __restrict__",
        slot_of: u64 as "u32*",
        miss_src: u64 as "u64*",
        stats: u64 as "unsigned long long* __restrict__",
        stamp: u32,
        counts: u64 as "u32*",
        cache: u64 as "uint4* __restrict__",
        scale: f32,
        part_acc: u64 as "float* __restrict__",
        part_ml: u64 as "float* __restrict__",
        ready: u64 as "u32*",
        tickets: u64 as "u32* __restrict__",
        ticket0: u32,
        lists: u32,
        nfixed: u32,
        batch: u32,
        // The sketch selector's (unused without it): candidates, the rerank roles' keys and
        // counters, the key sketches.
        cands: u64 as "u32*",
        rkeys: u64 as "u64*",
        rdone: u64 as "u32* __restrict__",
        sketches: u64 as "const unsigned char* __restrict__",
    }

    /// select_topk (select.cu): radix select over every score and the distant plan (top_k > 32).
    select_topk => SelectTopkParams {
        scratch: u64 as "const void* __restrict__",
        ntok: u64 as "const u32* __restrict__",
        max_blocks: u32,
        table: u64 as "u32*",
        sess: u64 as "const u32* __restrict__",
        layer: u32,
        tags: u64 as "u32* __restrict__",
        stamps: u64 as "u32* __restrict__",
        pages: u64 as "const u64* __restrict__",
        slot_of: u64 as "u32* __restrict__",
        miss_src: u64 as "u64* __restrict__",
        stats: u64 as "unsigned long long* __restrict__",
    }
}

pub(crate) use cuda_decls;

#[cfg(test)]
mod tests;
