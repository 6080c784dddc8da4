//! Mainstream open-model geometries on tierd's embedded defaults: every
//! block run size from a 270M model's 32 KiB to a 64-KV-head f32 model's 8 MiB is taken
//! without the operator resizing anything, each run costs its own size in the host tier (not
//! a fixed-size slot), and sessions of all of them side by side survive demotion to NVMe and a
//! restart with outputs that match the dense oracle.

mod common;

use common::*;
use kvtier_protocol::{DType, ErrorCode, Geometry};
use kvtier_storage::arena::DEFAULT_MAX_RUN_BYTES;

/// (model, geometry). A block run is 2 x block_tokens x kv_heads x head_dim x dtype bytes; it
/// does not depend on the layer count, so the sessions have 2 layers to keep the test small.
const MODELS: [(&str, Geometry); 6] = [
    // 1 KV head, D=256, 32-token blocks: 32 KiB runs.
    (
        "Gemma 3 270M bf16",
        Geometry::new(2, 4, 1, 256, DType::Bf16, 32),
    ),
    // 8 KV heads, D=128: 512 KiB runs (refused by the old fixed 256 KiB slot).
    (
        "Llama-3-8B bf16",
        Geometry::new(2, 32, 8, 128, DType::Bf16, 128),
    ),
    (
        "Qwen2.5-7B f32",
        Geometry::new(2, 28, 4, 128, DType::F32, 128),
    ),
    // 10 KV heads: a run that is no power of two (640 KiB).
    (
        "Phi-4 14B f32",
        Geometry::new(2, 40, 10, 128, DType::F32, 64),
    ),
    (
        "Gemma 3 27B f32",
        Geometry::new(2, 32, 16, 128, DType::F32, 128),
    ),
    // Full multi-head attention, 64 KV heads, in f32: 8 MiB runs.
    (
        "Command-R 35B (MHA) f32",
        Geometry::new(2, 64, 64, 128, DType::F32, 128),
    ),
];

/// 2.5 blocks: two full blocks and a partial tail.
fn tokens(g: &Geometry) -> u32 {
    g.block_tokens * 5 / 2
}

/// Host bytes a session holds with every block resident: one 4 KiB-rounded extent per run.
fn resident_bytes(g: &Geometry, tokens: u64) -> u64 {
    g.blocks_for(tokens) * g.layers as u64 * (g.block_bytes() as u64).next_multiple_of(4096)
}

/// Appends `n` shadow tokens in requests well under the 16 MiB message limit.
fn fill(c: &mut kvtier_protocol::client::Client, id: u64, sh: &mut Shadow, n: u32) {
    let g = sh.g;
    let per_token = 2 * (g.layers * g.kv_heads * g.head_dim) as usize * g.dtype.size();
    let chunk = ((4 << 20) / per_token).max(1) as u32;
    let mut at = 0;
    while at < n {
        let m = chunk.min(n - at);
        c.append_kv(id, at as u64, m, &sh.payload(m as usize))
            .unwrap();
        at += m;
    }
}

#[test]
fn open_model_geometries_work_on_the_defaults_and_survive_demotion_and_restart() {
    // Embedded defaults except the sizes of this machine's test tiers.
    let d = tierd()
        .host_capacity("256MiB")
        .nvme_capacity("256MiB")
        .start();
    let mut c = d.client();
    let mut sessions = Vec::new();
    for (i, (name, g)) in MODELS.iter().enumerate() {
        let id = c
            .create_session(*g, policy(), name)
            .unwrap_or_else(|e| panic!("{name} refused: {e}"));
        let mut sh = Shadow::new(*g, 100 + i as u64);
        fill(&mut c, id, &mut sh, tokens(g));
        sh.step(&mut c, id);
        let info = c.session_info(id).unwrap();
        assert_eq!(
            info.host_bytes,
            resident_bytes(g, tokens(g) as u64 + 1),
            "{name}: each run takes its own size"
        );
        sessions.push((id, sh));
    }
    let held: u64 = MODELS
        .iter()
        .map(|(_, g)| resident_bytes(g, tokens(g) as u64 + 1))
        .sum();
    // Plus, when tierd runs on a GPU, the decoder's zero extent: one run of max_run_bytes.
    let stats = c.stats().unwrap();
    let runs: u64 = MODELS.iter().map(|(_, g)| 3 * g.layers as u64).sum();
    let (used, extents) = (
        stats.get("host_bytes_used").unwrap(),
        stats.get("host_extents_used").unwrap(),
    );
    assert!(
        (used, extents) == (held, runs)
            || (used, extents) == (held + DEFAULT_MAX_RUN_BYTES as u64, runs + 1),
        "host tier holds {used} bytes in {extents} runs, sessions {held} in {runs}"
    );

    // To NVMe and back: pages of every size are written, read, verified and promoted.
    for (id, sh) in &mut sessions {
        assert!(c.demote(*id).unwrap() > 0);
        assert_eq!(c.session_info(*id).unwrap().host_bytes, 0);
        sh.step(&mut c, *id);
    }
    assert!(c.stats().unwrap().get("nvme_bytes_used").unwrap() > 0);

    // A clean restart finds every session in its manifest and pages.
    drop(c);
    let dir = d.stop(false);
    let d = tierd()
        .dir(dir)
        .host_capacity("256MiB")
        .nvme_capacity("256MiB")
        .start();
    let mut c = d.client();
    for (id, sh) in &mut sessions {
        let info = c.session_info(*id).unwrap();
        assert_eq!(info.tokens_max, sh.tokens(0));
        sh.step(&mut c, *id);
    }
}

#[test]
fn a_run_over_max_run_bytes_is_refused_with_the_setting_named() {
    let d = tierd().host_capacity("64MiB").no_nvme().start();
    let mut c = d.client();
    // 128 KV heads x D=256 x f32 x 128 tokens: a 32 MiB run, over the 16 MiB default.
    let huge = Geometry::new(2, 128, 128, 256, DType::F32, 128);
    let e = c.create_session(huge, policy(), "huge").unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidArgument), "{e}");
    assert!(e.to_string().contains("host.max_run_bytes"), "{e}");
    // Raising the setting admits it.
    let d = tierd()
        .host_capacity("128MiB")
        .no_nvme()
        .set("host.max_run_bytes=\"32MiB\"")
        .start();
    d.client().create_session(huge, policy(), "huge").unwrap();
}
