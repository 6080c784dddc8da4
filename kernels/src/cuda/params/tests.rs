//! The generated C parameter lists against the Rust structs, the kernels' signatures in the
//! NVRTC source, and the launch arguments. No GPU or NVRTC needed.

use super::{Field, KernelParams, SelectScoreParams, ALL};
use crate::cuda::KERNEL_SOURCE;

/// Size of a C parameter type: a pointer is 8 bytes on every 64-bit target CUDA runs on,
/// scalars as the fixed Rust -> C map gives them.
fn c_size(c_type: &str) -> usize {
    if is_c_pointer(c_type) {
        return 8;
    }
    match c_type {
        "unsigned int" | "int" | "float" => 4,
        "unsigned long long" => 8,
        other => panic!("C type {other:?} is not in the map"),
    }
}

fn is_c_pointer(c_type: &str) -> bool {
    c_type.ends_with('*') || c_type.ends_with("* __restrict__")
}

/// The struct name and (C type, name) of each parameter of a generated
/// `#define Name_FIELDS T a, U b\n`.
fn parse_decl(decl: &str) -> (&str, Vec<(&str, &str)>) {
    let rest = decl.strip_prefix("#define ").expect("a definition");
    let (name, list) = rest.split_once("_FIELDS ").expect("Name_FIELDS");
    let list = list.strip_suffix('\n').expect("one line");
    assert!(!list.contains('\n'), "{name}: one line");
    let params = list
        .split(", ")
        .map(|p| {
            let (ty, field) = p.rsplit_once(' ').expect("type and name");
            (ty, field)
        })
        .collect();
    (name, params)
}

/// Each kernel's C parameter list names the Rust fields in order, each with a C type of the
/// field's size, a pointer exactly where the field is a device address.
#[test]
fn c_parameter_lists_match_the_rust_fields() {
    assert_eq!(ALL.len(), 11, "one struct per kernel");
    for &(kernel, decl, fields) in ALL {
        let (_, params) = parse_decl(decl);
        let names: Vec<&str> = params.iter().map(|p| p.1).collect();
        let rust: Vec<&str> = fields.iter().map(|f| f.name).collect();
        assert_eq!(names, rust, "{kernel}: fields and their order");
        for ((c_type, name), f) in params.iter().zip(fields) {
            assert_eq!(c_size(c_type), f.size, "{kernel}.{name}: size");
            assert_eq!(is_c_pointer(c_type), f.pointer, "{kernel}.{name}: pointer");
        }
    }
}

/// Every `extern "C" __global__` kernel in the NVRTC source is declared with its struct's
/// generated parameter list (`name(NameParams_FIELDS)`), defined before it, and every struct
/// belongs to one kernel.
#[test]
fn every_kernel_is_declared_with_its_parameter_list() {
    let src = KERNEL_SOURCE;
    let mut kernels = Vec::new();
    for (at, _) in src.match_indices("extern \"C\" __global__ void ") {
        let head = &src[at..at + src[at..].find('{').expect("a body")];
        let open = head.rfind('(').expect("a parameter list");
        let close = head.rfind(')').expect("a parameter list");
        let name = head[..open]
            .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .next()
            .expect("a name");
        kernels.push((name, head[open + 1..close].to_string(), at));
    }
    let mut names: Vec<&str> = kernels.iter().map(|k| k.0).collect();
    names.sort_unstable();
    let mut declared: Vec<&str> = ALL.iter().map(|p| p.0).collect();
    declared.sort_unstable();
    assert_eq!(
        names, declared,
        "kernels in the source vs parameter structs"
    );
    for (name, params, at) in kernels {
        let &(_, decl, _) = ALL.iter().find(|p| p.0 == name).expect("declared");
        let (struct_name, _) = parse_decl(decl);
        assert_eq!(
            params,
            format!("{struct_name}_FIELDS"),
            "{name}'s parameters"
        );
        let decl_at = src.find(decl).expect("the definition in the source");
        assert!(decl_at < at, "{struct_name}_FIELDS defined after {name}");
    }
}

/// The launch arguments are the fields' addresses in declaration order.
#[test]
fn launch_arguments_are_the_fields_in_order() {
    let p = SelectScoreParams {
        q: 1,
        sums: 2,
        qscales: 3,
        sess: 4,
        ntok: 5,
        layer: 6,
        max_blocks: 7,
        nbo: 8,
        scratch: 9,
        done: 10,
        table: 11,
        tags: 12,
        stamps: 13,
        pages: 14,
        slot_of: 15,
        miss_src: 16,
        stats: 17,
        cands: 18,
    };
    let base = &p as *const SelectScoreParams as usize;
    let ptrs = p.arg_ptrs();
    let fields: &[Field] = SelectScoreParams::FIELDS;
    assert_eq!(ptrs.len(), fields.len());
    for (i, (&ptr, f)) in ptrs.iter().zip(fields).enumerate() {
        assert_eq!(ptr as usize - base, f.offset, "{}", f.name);
        // SAFETY: ptr points at field f of `p`, which is alive, of f.size bytes.
        let value = unsafe {
            match f.size {
                4 => (ptr as *const u32).read() as u64,
                8 => (ptr as *const u64).read(),
                s => panic!("size {s}"),
            }
        };
        assert_eq!(value, i as u64 + 1, "{}", f.name);
    }
}

/// The generated C text: the fixed type map and the pointer types as given.
#[test]
fn parameter_lists_read_as_c() {
    use super::CopyRunsParams;
    assert_eq!(
        CopyRunsParams::CUDA_DECL,
        "#define CopyRunsParams_FIELDS const u64* __restrict__ from, const u64* __restrict__ to, \
         unsigned int max_blocks, unsigned int n_blocks, unsigned long long run_vecs\n"
    );
    assert_eq!(CopyRunsParams::KERNEL, "copy_runs");
}
