//! Appends from the engine's device memory into tierd's arena by DMA (RESERVE, copy, COMMIT),
//! over a real tierd: the session then holds, run for run, byte for byte, what APPEND_KV of the
//! same rows gives a twin session, and the engine (its state updated from the reservation, not
//! a new lease) decodes both bit-identically. Every wrong use is a typed error that leaves the
//! session as it was. Skips (saying so) without a CUDA device.

use cudarc::driver::{CudaSlice, DevicePtr};
use kvtier_engine::{DeviceRows, EngineError, HeadShard, InEngine};
use kvtier_kernels::cuda::{device_context, CudaConfig, SummaryDtype};
use kvtier_protocol::client::{Client, ClientError};
use kvtier_protocol::lease::ArenaView;
use kvtier_protocol::{DType, ErrorCode, Geometry};
use kvtier_tests::session::{policy, Shadow};
use kvtier_tests::{bins, Tierd};

/// Qwen2.5-7B's attention shape on 3 layers, bf16, 128-token blocks.
const GEO: Geometry = Geometry::new(3, 28, 4, 128, DType::Bf16, 128);
/// Rows the device buffer holds per (layer, kv head, K|V): a block's worth.
const CAP: usize = 128;

fn config() -> CudaConfig {
    CudaConfig::new(GEO, policy(), 1024, 4, SummaryDtype::F32)
}

/// An APPEND_KV payload of `n` tokens (`[layer][k|v][n][kv_heads][head_dim]`) in the device
/// layout [`DeviceRows`] describes: `[layer][kv_head][k|v][CAP][head_dim]`, rows first.
fn device_layout(p: &[u8], n: usize) -> Vec<u8> {
    let (row, hkv, tb) = (GEO.row_bytes(), GEO.kv_heads as usize, GEO.token_bytes());
    let per_layer = hkv * 2 * CAP * row;
    let mut out = vec![0u8; GEO.layers as usize * per_layer];
    for l in 0..GEO.layers as usize {
        for kv in 0..2 {
            let src = &p[(2 * l + kv) * n * tb..(2 * l + kv + 1) * n * tb];
            for t in 0..n {
                for h in 0..hkv {
                    let at = l * per_layer + ((h * 2 + kv) * CAP + t) * row;
                    let from = (t * hkv + h) * row;
                    out[at..at + row].copy_from_slice(&src[from..from + row]);
                }
            }
        }
    }
    out
}

/// Every run of a session, read through a fresh lease on a connection of its own.
fn runs(d: &Tierd, id: u64) -> Vec<Vec<u8>> {
    let mut c = d.client();
    let (lease, fd) = c.lease(id).unwrap();
    let view = ArenaView::map(fd, &lease).unwrap();
    let mut out = Vec::new();
    for (l, layer) in lease.layers.iter().enumerate() {
        for b in 0..layer.offsets.len() {
            out.push(view.run(&lease, l, b).unwrap().to_vec());
        }
    }
    out
}

/// tierd on the CPU with a shared arena (only the engine uses the device); None, saying so,
/// without a CUDA device.
fn shared_tierd() -> Option<Tierd> {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return None;
    }
    let d = Tierd::builder(bins::tierd())
        .host_capacity("1GiB")
        .args(["--backend", "cpu"])
        .set("host.shared=true")
        .start();
    Some(d)
}

struct Device {
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
}

impl Device {
    fn new() -> Self {
        let ctx = device_context(0).unwrap();
        Device {
            stream: ctx.new_stream().unwrap(),
        }
    }

    fn upload(&self, bytes: &[u8]) -> CudaSlice<u8> {
        self.stream.clone_htod(bytes).unwrap()
    }

    fn rows(&self, buf: &CudaSlice<u8>) -> DeviceRows {
        DeviceRows {
            ptr: buf.device_ptr(&self.stream).0,
            layer_stride: (buf.len() / GEO.layers as usize) as u64,
            capacity: CAP as u32,
        }
    }

    fn append(
        &self,
        e: &mut InEngine,
        items: &[(u64, &CudaSlice<u8>)],
        n: usize,
    ) -> Result<(), EngineError> {
        let items: Vec<_> = items.iter().map(|&(s, b)| (s, self.rows(b))).collect();
        // SAFETY: each buffer is a live allocation of device 0's primary context laid out as
        // DeviceRows says, unchanged until the call returns; the stream is this context's.
        unsafe { e.append_from_device(&items, n as u32, self.stream.cu_stream()) }
    }
}

fn code(e: &EngineError) -> Option<ErrorCode> {
    match e {
        EngineError::Daemon(ClientError::Server { code, .. }) => Some(*code),
        _ => None,
    }
}

/// Output bits of every layer of `session` for fixed queries.
fn outputs(e: &mut InEngine, session: u64) -> Vec<Vec<u32>> {
    let mut rng = kvtier_storage::testing::Rng::new(77);
    (0..GEO.layers)
        .map(|l| {
            let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
            let out = e.decode_layer(l, &[(session, &q)]).unwrap().out;
            out.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn rows_appended_from_the_device_equal_append_kv_and_decode_alike() {
    let Some(d) = shared_tierd() else {
        return;
    };
    let mut c = d.client();
    // Twins: `dma` gets its appends from the device, `twin` the same rows through APPEND_KV.
    let mut sh = Shadow::new(GEO, 3);
    let first = sh.payload(300);
    let create = |c: &mut Client, label| {
        let s = c.create_session(GEO, policy(), label).unwrap();
        c.append_kv(s, 0, 300, &first).unwrap();
        s
    };
    let (dma, twin) = (create(&mut c, "dma"), create(&mut c, "twin"));
    let dev = Device::new();
    let mut e = InEngine::connect(d.path(), 0, config()).unwrap();
    e.enable_in_place_appends().unwrap();
    e.attach(dma).unwrap();
    e.attach(twin).unwrap();

    // Inside a block into the next (300 -> 340 -> 424), a whole block from inside one (424 ->
    // 552), then from a block boundary (640 -> 641 after 552 -> 640).
    let mut at = 300;
    for n in [40usize, 84, 128, 88, 1] {
        let p = sh.payload(n);
        c.append_kv(twin, at, n as u32, &p).unwrap();
        e.sync(twin).unwrap();
        let buf = dev.upload(&device_layout(&p, n));
        dev.append(&mut e, &[(dma, &buf)], n).unwrap();
        at += n as u64;
        assert_eq!(c.session_info(dma).unwrap().tokens_max, at);
        assert!(
            runs(&d, dma) == runs(&d, twin),
            "runs differ after {at} tokens"
        );
        assert_eq!(outputs(&mut e, dma), outputs(&mut e, twin), "at {at}");
    }
    // The engine's state came from the reservations; a full sync changes nothing.
    let before = outputs(&mut e, dma);
    e.sync(dma).unwrap();
    assert_eq!(outputs(&mut e, dma), before);

    // Two sessions in one call: `dma` and a third session, whose twin gets the same rows by
    // APPEND_KV.
    let p = sh.payload(64);
    c.append_kv(twin, at, 64, &p).unwrap();
    let (third, third_twin) = (create(&mut c, "third"), create(&mut c, "third twin"));
    e.attach(third).unwrap();
    let q = kvtier_tests::kv::payload(&GEO, 64, 11);
    c.append_kv(third_twin, 300, 64, &q).unwrap();
    let (one, other) = (
        dev.upload(&device_layout(&p, 64)),
        dev.upload(&device_layout(&q, 64)),
    );
    dev.append(&mut e, &[(dma, &one), (third, &other)], 64)
        .unwrap();
    assert!(runs(&d, dma) == runs(&d, twin));
    assert!(runs(&d, third) == runs(&d, third_twin));
    assert_eq!(c.session_info(third).unwrap().tokens_max, 364);
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn wrong_in_place_appends_are_typed_errors_that_change_nothing() {
    let Some(d) = shared_tierd() else {
        return;
    };
    let mut c = d.client();
    let mut sh = Shadow::new(GEO, 9);
    let s = c.create_session(GEO, policy(), "faults").unwrap();
    c.append_kv(s, 0, 200, &sh.payload(200)).unwrap();
    let dev = Device::new();
    let p = sh.payload(10);
    let good = dev.upload(&device_layout(&p, 10));
    let in_place = |r: Result<(), EngineError>| matches!(r, Err(EngineError::InPlace(_)));

    // Not enabled: refused before anything is reserved.
    let mut ro = InEngine::connect(d.path(), 0, config()).unwrap();
    ro.attach(s).unwrap();
    assert!(in_place(dev.append(&mut ro, &[(s, &good)], 10)));
    // Enabling after the arena was mapped read-only, or on a head shard: refused.
    assert!(matches!(
        ro.enable_in_place_appends(),
        Err(EngineError::InPlace(_))
    ));
    let shard = HeadShard { rank: 0, world: 2 };
    let mut sharded = InEngine::connect_shard(d.path(), 0, config(), shard).unwrap();
    assert!(matches!(
        sharded.enable_in_place_appends(),
        Err(EngineError::InPlace(_))
    ));
    drop(ro);

    let mut e = InEngine::connect(d.path(), 0, config()).unwrap();
    e.enable_in_place_appends().unwrap();
    // A session not attached, 0 rows, more rows than the buffer holds.
    assert!(matches!(
        dev.append(&mut e, &[(s, &good)], 10),
        Err(EngineError::Session { .. })
    ));
    e.attach(s).unwrap();
    assert!(in_place(dev.append(&mut e, &[(s, &good)], 0)));
    assert!(in_place(dev.append(&mut e, &[(s, &good)], CAP + 1)));
    // A NaN in the rows: COMMIT refuses it (INVALID_ARGUMENT), the session is as it was and
    // takes the next append (the reservation is over).
    let before = runs(&d, s);
    let mut bad = device_layout(&p, 10);
    bad[5 * GEO.row_bytes()..5 * GEO.row_bytes() + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
    let bad = dev.upload(&bad);
    let err = dev.append(&mut e, &[(s, &bad)], 10).unwrap_err();
    assert_eq!(code(&err), Some(ErrorCode::InvalidArgument), "{err}");
    assert_eq!(c.session_info(s).unwrap().tokens_max, 200);
    assert!(runs(&d, s) == before);
    dev.append(&mut e, &[(s, &good)], 10).unwrap();
    assert_eq!(c.session_info(s).unwrap().tokens_max, 210);
    // An APPEND_KV from another connection meanwhile: the engine notices the reservation
    // does not continue what it holds and syncs in full; the decode is the daemon's state.
    c.append_kv(s, 210, 5, &sh.payload(5)).unwrap();
    let p = sh.payload(3);
    let more = dev.upload(&device_layout(&p, 3));
    dev.append(&mut e, &[(s, &more)], 3).unwrap();
    assert_eq!(c.session_info(s).unwrap().tokens_max, 218);
    let now = outputs(&mut e, s);
    e.sync(s).unwrap();
    assert_eq!(outputs(&mut e, s), now);
}
